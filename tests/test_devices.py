"""In-process device placement: ``agent_devices``, ``critic_devices``, ``reference_devices``, ``reward_model_device``.

Impossible placements must fail when the trainer is built, naming the config field and the fix,
before any weights load: the trainers here are built on *weightless* copies of the tiny models,
so a check that came after loading would fail with an ``OSError`` instead. On this CPU machine
every placement is the CPU; the tests at the end need CUDA devices and are skipped without them.
"""

import shutil
import threading

import pytest
import torch

from comlrl_core import rollout
from comlrl_core.devices import auto_devices, check_device_spec, resolve_devices
from comlrl_core.entities import place_entities, plan_entities
from comlrl_core.environments import length_ratio_dataset, length_ratio_reward
from comlrl_core.rollout import reference_kl, sample, sample_agents
from comlrl_core.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl_core.trainers.checkpointing import PORTABLE_FIELDS
from comlrl_core.trainers.preference import MARLHFConfig, MARLHFTrainer
from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

CPU = torch.device("cpu")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
no_cuda = pytest.mark.skipif(GPUS > 0, reason="needs a machine without CUDA")
GENERATION = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 6}


def small(config_class, **overrides):
    base = dict(num_agents=2, num_train_epochs=1, max_new_tokens=4, num_generations=2, rollout_buffer_size=1,
                eval_interval=0, verbose=False)
    if issubclass(config_class, MARLHFConfig):
        base.update(reward_model_device=None, preference_num_candidates=4, preference_pairs_per_sample=2)
    return config_class(**{**base, **overrides})


def build(trainer_class, config_class, models, **overrides):
    kwargs = dict(agent_model=models["qwen2-tiny"], reward_func=length_ratio_reward,
                  train_dataset=length_ratio_dataset(2), args=small(config_class, **overrides))
    if trainer_class in (IACTrainer, MAACTrainer) and overrides.get("use_separate_critic", True):
        kwargs["critic_model"] = models["llama-tiny"]
    return trainer_class(**kwargs)


def devices_of(module) -> set:
    return {p.device for p in module.parameters()} | {b.device for b in module.buffers()}


@pytest.fixture(scope="module")
def weightless(tiny_models, tmp_path_factory):
    """The tiny model dirs without their weights: loading them fails, so only earlier checks can pass."""
    root = tmp_path_factory.mktemp("weightless")
    for name in ("qwen2-tiny", "llama-tiny"):
        shutil.copytree(tiny_models[name], root / name, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return {name: str(root / name) for name in ("qwen2-tiny", "llama-tiny")}


# ---- the config checks the form (machine-independent) ---------------------------------------------

@pytest.mark.parametrize("config_class, field, value, match", [
    (MAGRPOConfig, "agent_devices", "gpu0", r"MAGRPOConfig.agent_devices='gpu0' is not a device; use 'cpu'"),
    (MAGRPOConfig, "agent_devices", 0, r"MAGRPOConfig.agent_devices=0 is not a device"),
    (MAGRPOConfig, "agent_devices", "meta", r"agent_devices='meta' is not a device"),
    (MAGRPOConfig, "agent_devices", [], r"MAGRPOConfig.agent_devices=\[\] is empty; give one device per"),
    (MAGRPOConfig, "reference_devices", ["cpu", "cuda:x"], r"MAGRPOConfig.reference_devices\[1\]='cuda:x' is not"),
    (IACConfig, "critic_devices", ["auto"], r"IACConfig.critic_devices\[0\]='auto' is not a device"),
    (MAACConfig, "critic_devices", True, r"MAACConfig.critic_devices=True is not a device"),
    (MARLHFConfig, "critic_devices", {"a": 1}, r"MARLHFConfig.critic_devices=\{'a': 1\} is not a device"),
])
def test_config_refuses_malformed_device_settings(config_class, field, value, match):
    with pytest.raises(ValueError, match=match):
        config_class(**{field: value})


def test_config_keeps_device_settings_as_json():
    config = MARLHFConfig(agent_devices=[CPU, "cuda:1"], reference_devices="auto", critic_devices=CPU,
                          reward_model_device=CPU)
    assert (config.agent_devices, config.reference_devices) == (["cpu", "cuda:1"], "auto")
    assert (config.critic_devices, config.reward_model_device) == ("cpu", "cpu")
    # A GPU placement is a valid config on a CPU machine (it may run elsewhere); the trainer checks it.
    assert IACConfig(critic_devices=["cuda:0", "cuda:7"]).critic_devices == ["cuda:0", "cuda:7"]
    assert check_device_spec(None, "x") is None


def test_device_settings_may_change_on_resume():
    assert {"agent_devices", "critic_devices", "reference_devices", "reward_model_device"} <= PORTABLE_FIELDS


# ---- the trainer checks counts and the machine, before any weights load ---------------------------

@pytest.mark.parametrize("trainer_class, config_class, overrides, match", [
    (MAGRPOTrainer, MAGRPOConfig, dict(agent_devices=["cpu"]),
     r"MAGRPOConfig.agent_devices has 1 entry but there are 2 agents; give one device per agent, one device for "
     r"all \(e.g. agent_devices='cuda:1'\), 'auto' or None"),
    (MAGRPOTrainer, MAGRPOConfig, dict(reference_devices=["cpu"] * 3, reference_kl_enabled=True),
     r"MAGRPOConfig.reference_devices has 3 entries but there are 2 agents"),
    (IACTrainer, IACConfig, dict(critic_devices=["cpu"]),
     r"IACConfig.critic_devices has 1 entry but there are 2 critics; give one device per critic"),
    (IACTrainer, IACConfig, dict(critic_devices="cpu", use_separate_critic=False),
     r"IACConfig.critic_devices='cpu' places nothing: the value heads live on their actors.*critic_devices=None"),
    (MAACTrainer, MAACConfig, dict(critic_devices=["cpu", "cpu"]),
     r"MAACConfig.critic_devices has 2 entries but there is 1 critic"),
    (MARLHFTrainer, MARLHFConfig, dict(critic_devices="cpu"),
     r"MARLHFConfig.critic_devices='cpu' places nothing: this algorithm has no critic"),
    (MARLHFTrainer, MARLHFConfig, dict(rl_algorithm="iac", critic_devices=["cpu"] * 3),
     r"MARLHFConfig.critic_devices has 3 entries but there are 2 critics"),
    (MARLHFTrainer, MARLHFConfig, dict(rl_algorithm="maac", agent_devices=["cpu"]),
     r"MARLHFConfig.agent_devices has 1 entry but there are 2 agents"),
])
def test_impossible_placements_fail_before_weights_load(weightless, trainer_class, config_class, overrides, match):
    with pytest.raises(ValueError, match=match):
        build(trainer_class, config_class, weightless, **overrides)


@no_cuda
@pytest.mark.parametrize("trainer_class, config_class, overrides, match", [
    (MAGRPOTrainer, MAGRPOConfig, dict(agent_devices="cuda"),
     r"MAGRPOConfig.agent_devices='cuda' is not available: CUDA is not available on this machine. "
     r"Set agent_devices=None \(the trainer's device\), 'auto', or a device this machine has: 'cpu'"),
    (MAGRPOTrainer, MAGRPOConfig, dict(agent_devices=["cpu", "cuda:1"]),
     r"MAGRPOConfig.agent_devices\[1\]='cuda:1' is not available.*Set agent_devices=None"),
    (MAGRPOTrainer, MAGRPOConfig, dict(reference_devices="cuda:0"),  # checked even with the KL off
     r"MAGRPOConfig.reference_devices='cuda:0' is not available"),
    (IACTrainer, IACConfig, dict(critic_devices=["cpu", "cuda:0"]), r"IACConfig.critic_devices\[1\]='cuda:0'"),
    (MAACTrainer, MAACConfig, dict(critic_devices="cuda:0"), r"MAACConfig.critic_devices='cuda:0' is not available"),
    (MARLHFTrainer, MARLHFConfig, dict(reward_model_device="cuda:1"),
     r"MARLHFConfig.reward_model_device='cuda:1' is not available.*reward_model_device=None"),
    (MARLHFTrainer, MARLHFConfig, dict(agent_devices="cuda:0"), r"MARLHFConfig.agent_devices='cuda:0' is not"),
])
def test_missing_cuda_devices_fail_before_weights_load(weightless, trainer_class, config_class, overrides, match):
    with pytest.raises(ValueError, match=match):
        build(trainer_class, config_class, weightless, **overrides)


def test_a_valid_placement_reaches_the_weights(weightless):
    """The check above is not refusing everything: a placement this machine can honour gets to loading."""
    with pytest.raises(OSError, match="could not load model"):
        build(MAGRPOTrainer, MAGRPOConfig, weightless, agent_devices=["cpu", "cpu"], reference_devices="auto")


def test_data_parallel_jobs_refuse_explicit_placements(weightless):
    plan = plan_entities(owner="MAGRPOTrainer", family="magrpo", config_name="MAGRPOConfig",
                         agent_model=weightless["qwen2-tiny"], num_agents=2)
    with pytest.raises(ValueError, match=r"MAGRPOConfig.agent_devices='cpu': in a data-parallel job every process "
                                         r"trains on its own device \(cpu\); set agent_devices=None or 'auto'"):
        place_entities(plan, MAGRPOConfig(agent_devices="cpu"), default=CPU, data_parallel=True)
    placed = place_entities(plan, MAGRPOConfig(agent_devices="auto", reference_devices="auto"), default=CPU,
                            data_parallel=True)
    assert placed.agents == placed.references == [CPU, CPU]


# ---- placement ------------------------------------------------------------------------------------

@no_cuda
def test_auto_is_the_cpu_without_cuda():
    assert auto_devices(3) == [CPU] * 3
    assert resolve_devices("auto", 2, "X.agent_devices") == [CPU, CPU]


def test_auto_spreads_round_robin_over_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert auto_devices(3) == [torch.device("cuda", i) for i in (0, 1, 0)]
    assert auto_devices(1, start=3) == [torch.device("cuda", 1)]  # e.g. the MAAC critic after three agents


def test_defaults_follow_the_agents(weightless):
    """None: agents on the trainer's device, references and IAC critics on their agent's, the MAAC
    critic and the reward model on agent 0's."""
    plan = plan_entities(owner="IACTrainer", family="actor_critic", config_name="IACConfig",
                         agent_model=weightless["qwen2-tiny"], critic_model=weightless["llama-tiny"],
                         critic_layout="separate", config_num_agents=2)
    placed = place_entities(plan, IACConfig(num_agents=2, agent_devices=["cpu", CPU]), default=CPU)
    assert placed.agents == placed.critics == placed.references == [CPU, CPU]
    assert placed.reward is None
    plan = plan_entities(owner="MARLHFTrainer", family="magrpo", config_name="MARLHFConfig",
                         agent_model=weightless["qwen2-tiny"], num_agents=3, reward_model=True,
                         critic_layout="central", critic_defaults_to_actor=True, reward_model_device="auto")
    placed = place_entities(plan, MARLHFConfig(rl_algorithm="maac", reward_model_device="auto"), default=CPU)
    assert placed.critics == [CPU] and placed.reward == plan.reward_model_device == auto_devices(1, start=3)[0]


def test_cpu_placements_put_every_model_on_the_cpu(tiny_models):
    trainer = build(MAGRPOTrainer, MAGRPOConfig, tiny_models, agent_devices=["cpu", "cpu"], reference_devices="auto",
                    reference_kl_enabled=True)
    assert trainer.placement.agents == trainer.placement.references == [CPU, CPU]
    for agent, ref in zip(trainer.agents, trainer.reference_models):
        assert devices_of(agent) == devices_of(ref) == {CPU}
        assert not ref.training and not any(p.requires_grad for p in ref.parameters())
        assert all(torch.equal(a, b) for a, b in zip(agent.parameters(), ref.parameters()))
        assert not {p.data_ptr() for p in agent.parameters()} & {p.data_ptr() for p in ref.parameters()}
    # Agent and reference on their own devices: the KL is computed on the CPU from each one's log-probs.
    comp = sample(trainer.agents[0], trainer.tokenizers[0], "Say hi", 2, GENERATION)
    assert reference_kl(trainer.agents[0], trainer.reference_models[0], comp) == pytest.approx([0.0, 0.0], abs=1e-5)

    iac = build(IACTrainer, IACConfig, tiny_models, critic_devices=["cpu", "cpu"], agent_devices="cpu")
    assert [devices_of(m) for m in [*iac.agents, *iac.critics]] == [{CPU}] * 4
    maac = build(MAACTrainer, MAACConfig, tiny_models, critic_devices="auto", reference_kl_enabled=True,
                 reference_devices=["cpu", "cpu"])
    assert [devices_of(m) for m in [*maac.critics, *maac.reference_models]] == [{CPU}] * 3


def test_marlhf_places_the_reward_model_and_forwards_devices(tiny_models):
    trainer = build(MARLHFTrainer, MARLHFConfig, tiny_models, rl_algorithm="iac", reward_model_device="auto",
                    reward_model_name=tiny_models["llama-tiny"], agent_devices="cpu", critic_devices=["cpu", "cpu"],
                    reference_devices="auto")
    args = trainer.policy.args
    assert (args.agent_devices, args.critic_devices, args.reference_devices) == ("cpu", ["cpu", "cpu"], "auto")
    assert trainer.placement.reward == CPU
    trainer._init_reward_model()
    assert devices_of(trainer.reward_model) == {CPU}
    assert trainer.score(["a joint sample", "another"]).shape == (2,)
    maac = build(MARLHFTrainer, MARLHFConfig, tiny_models, rl_algorithm="maac", critic_devices="cpu")
    assert maac.policy.args.critic_devices == "cpu" and devices_of(maac.critics[0]) == {CPU}


# ---- sampling every agent ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_agents(tiny_models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = ("qwen2-tiny", "llama-tiny")
    return ([AutoModelForCausalLM.from_pretrained(tiny_models[n]) for n in names],
            [AutoTokenizer.from_pretrained(tiny_models[n]) for n in names])


def same(a, b) -> bool:
    return all(torch.equal(x.completion_ids, y.completion_ids) and torch.equal(x.mask, y.mask) and x.texts == y.texts
               and torch.equal(x.prompt_ids, y.prompt_ids) for x, y in zip(a, b, strict=True))


def test_sample_agents_on_cpu_equals_sequential_sampling(two_agents):
    policies, tokenizers = two_agents
    prompts = ["Write a word.", "Write a longer sentence."]
    torch.manual_seed(3)
    sequential = [sample(p, t, q, 3, GENERATION) for p, t, q in zip(policies, tokenizers, prompts)]
    torch.manual_seed(3)
    assert same(sample_agents(policies, tokenizers, prompts, 3, GENERATION), sequential)
    with pytest.raises(ValueError, match="2 policies, 1 tokenizers, prompts for \\[2\\] agents"):
        sample_agents(policies, tokenizers[:1], prompts, 3, GENERATION)


def test_sample_agents_worker_threads_give_the_sequential_result(two_agents, monkeypatch):
    """The threaded path, forced on the CPU: one worker per device, tokenizers on the calling thread."""
    policies, tokenizers = two_agents
    prompts = ["Write a word.", "Write a longer sentence."]
    torch.manual_seed(5)
    sequential = [sample(p, t, q, 2, GENERATION) for p, t, q in zip(policies, tokenizers, prompts)]
    threads = []
    draw = rollout._draw

    def recording(*args, **kwargs):
        threads.append(threading.current_thread())
        return draw(*args, **kwargs)

    monkeypatch.setattr(rollout, "_worker_devices", lambda devices: list(dict.fromkeys(devices)))
    monkeypatch.setattr(rollout, "_draw", recording)
    torch.manual_seed(5)
    assert same(sample_agents(policies, tokenizers, prompts, 2, GENERATION), sequential)
    assert len(threads) == 2 and all(t is not threading.main_thread() for t in threads)
    with pytest.raises(ValueError, match="encodes to no tokens"):  # raised on the calling thread, as before
        sample_agents(policies, tokenizers, ["", "x"], 2, GENERATION)

    def failing(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(rollout, "_draw", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        sample_agents(policies, tokenizers, prompts, 2, GENERATION)


# ---- with CUDA devices (skipped on CPU machines) ----------------------------------------------------

@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_mixed_cpu_and_cuda_placement(tiny_models):
    trainer = build(MAGRPOTrainer, MAGRPOConfig, tiny_models, agent_devices=["cpu", "cuda:0"],
                    reference_devices=["cuda:0", "cpu"], reference_kl_enabled=True)
    cuda = torch.device("cuda", 0)
    assert [devices_of(a) for a in trainer.agents] == [{CPU}, {cuda}]
    assert [devices_of(r) for r in trainer.reference_models] == [{cuda}, {CPU}]
    completions = sample_agents(trainer.agents, trainer.tokenizers, ["a", "b"], 2, GENERATION)
    for agent, ref, comp in zip(trainer.agents, trainer.reference_models, completions):
        assert reference_kl(agent, ref, comp) == pytest.approx([0.0, 0.0], abs=1e-3)
    marlhf = build(MARLHFTrainer, MARLHFConfig, tiny_models, agent_devices="cpu", reward_model_device="cuda:0")
    marlhf._init_reward_model()
    assert devices_of(marlhf.reward_model) == {cuda} and marlhf.score(["x"]).device == CPU


@pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices")
def test_sample_agents_overlaps_on_two_gpus_and_stays_deterministic(two_agents):
    policies, tokenizers = two_agents
    policies = [p.to(f"cuda:{i}") for i, p in enumerate(policies)]
    prompts = ["Write a word.", "Write a longer sentence."]
    torch.manual_seed(7)
    sequential = [sample(p, t, q, 4, GENERATION) for p, t, q in zip(policies, tokenizers, prompts)]
    assert rollout._worker_devices([next(p.parameters()).device for p in policies])
    torch.manual_seed(7)
    assert same(sample_agents(policies, tokenizers, prompts, 4, GENERATION), sequential)
