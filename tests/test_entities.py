"""Every seed rule on agents, critics, tokenizers and reward models, with directories and loaded objects."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl_core.entities import load_agents, load_critics, load_reward_model, plan_entities

CPU = torch.device("cpu")


def magrpo(**kwargs):
    return plan_entities(owner="MAGRPOTrainer", family="magrpo", config_name="MAGRPOConfig", **kwargs)


def iac(separate=True, **kwargs):
    return plan_entities(owner="IACTrainer", family="actor_critic", config_name="IACConfig",
                         critic_layout="separate" if separate else "shared", **kwargs)


def maac(**kwargs):
    return plan_entities(owner="MAACTrainer", family="actor_critic", config_name="MAACConfig",
                         critic_layout="central", **kwargs)


def marlhf(**kwargs):
    kwargs.setdefault("reward_model_device", None)
    return plan_entities(owner="MARLHFTrainer", family="magrpo", config_name="MARLHFConfig",
                         reward_model=True, critic_defaults_to_actor=True, **kwargs)


@pytest.fixture()
def objects(tiny_models):
    """Loaded model objects (with a name_or_path) and their tokenizers."""
    load = AutoModelForCausalLM.from_pretrained
    return {
        "qwen": load(tiny_models["qwen2-tiny"]),
        "llama": load(tiny_models["llama-tiny"]),
        "other": load(tiny_models["llama-other-vocab"]),
        "tok": AutoTokenizer.from_pretrained(tiny_models["qwen2-tiny"]),
        "other_tok": AutoTokenizer.from_pretrained(tiny_models["llama-other-vocab"]),
    }


def nameless(model):
    """A model object with no loadable name, like one built from a config."""
    model.name_or_path = ""
    model.config._name_or_path = ""
    return model


# ---- agents and the number of agents -------------------------------------------------------------

def test_neither_agent_model_nor_agents(tiny_models):
    with pytest.raises(ValueError, match="Either agent_model or agents must be provided"):
        magrpo()


def test_homogeneous_agents_load_independent_copies(tiny_models):
    plan = magrpo(agent_model=tiny_models["qwen2-tiny"], num_agents=3)
    assert plan.num_agents == 3 and plan.agent_sources == [tiny_models["qwen2-tiny"]] * 3
    agents = load_agents(plan, CPU)
    assert len({id(a) for a in agents}) == 3
    first = [p.data_ptr() for p in agents[0].parameters()]
    assert not set(first) & {p.data_ptr() for p in agents[1].parameters()}
    assert all(torch.equal(a, b) for a, b in zip(agents[0].parameters(), agents[2].parameters()))


def test_heterogeneous_agents_keep_order_and_their_own_tokenizers(tiny_models):
    dirs = [tiny_models["qwen2-tiny"], tiny_models["llama-other-vocab"], tiny_models["llama-tiny"]]
    plan = magrpo(agents=dirs)  # three agents with the default num_agents: the reference's IndexError
    assert plan.num_agents == 3
    assert [len(t) for t in plan.tokenizers] == [505, 384, 505]
    agents = load_agents(plan, CPU)
    assert [a.config.model_type for a in agents] == ["qwen2", "llama", "llama"]
    assert agents[1].config.vocab_size == 384


def test_agent_model_and_agents_must_agree(tiny_models):
    d = tiny_models["qwen2-tiny"]
    assert magrpo(agent_model=d, agents=[d, d + "/"], num_agents=2).num_agents == 2  # same dir, other spelling
    with pytest.raises(ValueError, match="agent_model and agents conflict"):
        magrpo(agent_model=d, agents=[d, tiny_models["llama-tiny"]])
    with pytest.raises(ValueError, match=r"num_agents=3, len\(agents\)=2"):
        magrpo(agent_model=d, agents=[d, d], num_agents=3)


def test_agent_model_and_nameless_objects_cannot_be_checked(tiny_models, objects):
    with pytest.raises(ValueError, match="Cannot check that agent_model and agents agree"):
        magrpo(agent_model=tiny_models["qwen2-tiny"], agents=[nameless(objects["qwen"]), objects["llama"]],
               tokenizer=objects["tok"])


def test_loaded_objects_are_matched_by_name(tiny_models, objects):
    plan = magrpo(agent_model=tiny_models["qwen2-tiny"], agents=[objects["qwen"]], num_agents=1,
                  tokenizer=objects["tok"])
    assert plan.agent_sources == [objects["qwen"]]


def test_constructor_num_agents_is_authoritative_for_magrpo(tiny_models):
    d = tiny_models["qwen2-tiny"]
    assert magrpo(agent_model=d, num_agents=3, config_num_agents=3).num_agents == 3
    assert magrpo(agent_model=d).num_agents == 2
    with pytest.raises(ValueError, match=r"num_agents \(constructor default\)=2, MAGRPOConfig.num_agents=3"):
        magrpo(agent_model=d, config_num_agents=3)
    with pytest.raises(ValueError, match="MAGRPOConfig.num_agents=3"):
        magrpo(agents=[d, d], config_num_agents=3)


def test_config_num_agents_is_authoritative_for_actor_critic(tiny_models):
    d = tiny_models["qwen2-tiny"]
    assert iac(separate=False, agent_model=d, config_num_agents=3).num_agents == 3
    with pytest.raises(ValueError, match=r"len\(agents\)=3, IACConfig.num_agents=2"):
        iac(separate=False, agents=[d, d, d], tokenizer=AutoTokenizer.from_pretrained(d), config_num_agents=2)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_num_agents_must_be_a_positive_integer(tiny_models, bad):
    with pytest.raises(ValueError, match="num_agents must be a positive integer"):
        magrpo(agent_model=tiny_models["qwen2-tiny"], num_agents=bad)


def test_malformed_agent_lists(tiny_models):
    d = tiny_models["qwen2-tiny"]
    with pytest.raises(TypeError, match="agents must be a list"):
        magrpo(agents=d)
    with pytest.raises(ValueError, match="agents is an empty list"):
        magrpo(agents=[])
    with pytest.raises(TypeError, match=r"agents\[1\] must be a Hugging Face model id"):
        magrpo(agents=[d, None])
    with pytest.raises(TypeError, match=r"agents\[0\] must be .* got int"):
        magrpo(agents=[3])


def test_missing_and_non_model_directories(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="local directory does not exist"):
        magrpo(agent_model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="has no config.json"):
        magrpo(agent_model=str(tmp_path))


def test_pickled_weights_holding_objects_are_refused_naming_the_file(tiny_models, tmp_path):
    import datetime

    from safetensors.torch import load_file

    model = tmp_path / "pickled"
    shutil.copytree(tiny_models["qwen2-tiny"], model)
    weights = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    torch.save({**weights, "not_a_tensor": datetime.date(2026, 12, 7)}, model / "pytorch_model.bin")
    with pytest.raises(ValueError, match=rf"agents\[0\]: {model / 'pytorch_model.bin'} of model .* holds pickled "
                                         "objects other than plain tensors, which are never unpickled"):
        load_agents(magrpo(agent_model=str(model), num_agents=2), CPU)


def test_rules_are_checked_before_any_weights_load(tiny_models, tmp_path):
    weightless = tmp_path / "weightless"
    shutil.copytree(tiny_models["qwen2-tiny"], weightless)
    (weightless / "model.safetensors").unlink()
    plan = magrpo(agent_model=str(weightless), num_agents=2)  # configs and tokenizers only
    with pytest.raises(ValueError, match="Either critic_model or critics"):
        maac(agent_model=str(weightless))
    with pytest.raises(OSError, match=r"agents\[0\]: could not load model"):
        load_agents(plan, CPU)


# ---- shared weights --------------------------------------------------------------------------------

def test_same_object_for_two_agents_needs_opt_in(objects):
    with pytest.raises(ValueError, match=r"agents\[0\] and agents\[1\] are the same model object"):
        magrpo(agents=[objects["qwen"], objects["qwen"]], tokenizer=objects["tok"])
    with pytest.raises(ValueError, match="allow_shared_models=True"):
        magrpo(agent_model=objects["qwen"], num_agents=2, tokenizer=objects["tok"])
    plan = magrpo(agents=[objects["qwen"], objects["qwen"]], tokenizer=objects["tok"], allow_shared_models=True)
    agents = load_agents(plan, CPU)
    assert agents[0] is agents[1]
    assert magrpo(agent_model=objects["qwen"], num_agents=1, tokenizer=objects["tok"]).num_agents == 1


def test_actor_object_reused_as_critic_needs_opt_in(objects):
    with pytest.raises(ValueError, match=r"agents\[0\] and critics\[0\] are the same model object"):
        iac(agents=[objects["qwen"], objects["llama"]], tokenizer=objects["tok"], critics=[objects["qwen"], objects["llama"]])
    with pytest.raises(ValueError, match=r"critics\[0\] and critics\[1\] are the same model object"):
        iac(agents=[objects["qwen"], objects["llama"]], tokenizer=objects["tok"], critic_model=nameless(objects["other"]))


# ---- tokenizers ------------------------------------------------------------------------------------

def test_magrpo_auto_loads_tokenizers_for_ids(tiny_models):
    plan = magrpo(agent_model=tiny_models["qwen2-tiny"], num_agents=2)
    assert plan.tokenizers[0].name_or_path == tiny_models["qwen2-tiny"]
    assert plan.tokenizers[0].pad_token_id is not None


def test_model_objects_need_a_tokenizer(tiny_models, objects):
    with pytest.raises(ValueError, match=r"agents\[1\] is a loaded model object.*tokenizer="):
        magrpo(agents=[tiny_models["qwen2-tiny"], objects["llama"]])
    plan = magrpo(agents=[objects["qwen"], objects["llama"]], tokenizer=objects["tok"])
    assert plan.tokenizers == [objects["tok"], objects["tok"]]


def test_tokenizer_list_must_match_and_is_honoured(tiny_models, objects):
    dirs = [tiny_models["qwen2-tiny"], tiny_models["llama-other-vocab"]]
    with pytest.raises(ValueError, match="tokenizer has 1 entries but there are 2 agents"):
        magrpo(agents=dirs, tokenizer=[objects["tok"]])
    plan = magrpo(agents=dirs, tokenizer=[objects["tok"], objects["other_tok"]])
    assert plan.tokenizers[0] is objects["tok"] and plan.tokenizers[1] is objects["other_tok"]


def test_actor_critic_requires_tokenizer_with_agents(tiny_models):
    dirs = [tiny_models["qwen2-tiny"], tiny_models["llama-tiny"]]
    with pytest.raises(ValueError, match="tokenizer is required when agents is given"):
        iac(separate=False, agents=dirs, config_num_agents=2)
    with pytest.raises(ValueError, match="tokenizer is required when agents is given"):
        maac(agents=dirs, critic_model=dirs[0])


def test_actor_critic_auto_loads_for_agent_model_and_honours_a_list(tiny_models, objects):
    d = tiny_models["qwen2-tiny"]
    assert iac(separate=False, agent_model=d).tokenizers[0].name_or_path == d
    other = AutoTokenizer.from_pretrained(d)
    plan = iac(separate=False, agent_model=d, tokenizer=[objects["tok"], other])  # the reference drops this list
    assert plan.tokenizers[0] is objects["tok"] and plan.tokenizers[1] is other
    with pytest.raises(ValueError, match="agent_model is a loaded model object"):
        iac(separate=False, agent_model=objects["qwen"], config_num_agents=1)


def test_agent_with_an_incompatible_tokenizer(tiny_models, objects):
    with pytest.raises(ValueError, match="agent 0 .* has 384 embedding rows"):
        magrpo(agents=[tiny_models["llama-other-vocab"]], tokenizer=[objects["tok"]])
    with pytest.raises(ValueError, match="different vocabulary"):
        magrpo(agents=[tiny_models["qwen2-tiny"]], tokenizer=[objects["other_tok"]])
    with pytest.raises(ValueError, match="agent 0 .* has 384 embedding rows"):
        magrpo(agents=[objects["other"]], tokenizer=objects["tok"])


def test_tokenizer_without_eos_is_refused(tiny_models, objects):
    tok = objects["tok"]
    tok.pad_token = None
    tok.eos_token = None
    with pytest.raises(ValueError, match="has no eos token"):
        magrpo(agents=[objects["qwen"]], tokenizer=tok)


# ---- critics ---------------------------------------------------------------------------------------

def test_maac_centralised_critic(tiny_models):
    dirs = [tiny_models["qwen2-tiny"], tiny_models["llama-tiny"]]
    toks = [AutoTokenizer.from_pretrained(d) for d in dirs]
    plan = maac(agents=dirs, tokenizer=toks, critic_model=tiny_models["qwen2-small"])
    assert plan.critic_sources == [tiny_models["qwen2-small"]]
    assert maac(agents=dirs, tokenizer=toks, critics=[tiny_models["qwen2-small"]]).critic_sources == plan.critic_sources
    with pytest.raises(ValueError, match="critics has 2 entries but there are 1 critic"):
        maac(agents=dirs, tokenizer=toks, critics=dirs)
    with pytest.raises(ValueError, match="MAACTrainer: Either critic_model or critics must be provided"):
        maac(agents=dirs, tokenizer=toks)
    with pytest.raises(ValueError, match="critic_model and critics conflict"):
        maac(agents=dirs, tokenizer=toks, critic_model=dirs[0], critics=[tiny_models["qwen2-small"]])
    critics = load_critics(plan, [CPU], value_head_hidden_dim=None, field="model_config['critic_value_head_hidden_dim']")
    assert critics[0].value_head.value_projection.in_features == 48


def test_maac_critic_reads_agent_zero_tokens(tiny_models):
    dirs = [tiny_models["qwen2-tiny"], tiny_models["llama-other-vocab"]]
    toks = [AutoTokenizer.from_pretrained(d) for d in dirs]
    assert maac(agents=dirs, tokenizer=toks, critic_model=tiny_models["llama-tiny"]).num_agents == 2
    with pytest.raises(ValueError, match="critic 0 .* has 384 embedding rows but agent 0's tokenizer"):
        maac(agents=dirs, tokenizer=toks, critic_model=tiny_models["llama-other-vocab"])


def test_iac_separate_critics(tiny_models):
    dirs = [tiny_models["qwen2-tiny"], tiny_models["llama-other-vocab"]]
    toks = [AutoTokenizer.from_pretrained(d) for d in dirs]
    plan = iac(agents=dirs, tokenizer=toks, critics=dirs)
    critics = load_critics(plan, [CPU, CPU], value_head_hidden_dim=8, field="IACConfig.critic_value_head_hidden_dim")
    assert [c.config.vocab_size for c in critics] == [505, 384]
    assert critics[1].value_head.pre_projection[0].out_features == 8
    homogeneous = iac(agent_model=dirs[0], critic_model=tiny_models["llama-tiny"])
    pair = load_critics(homogeneous, [CPU, CPU], value_head_hidden_dim=None, field="x")
    assert pair[0] is not pair[1] and pair[0].model is not pair[1].model  # one copy per agent
    with pytest.raises(ValueError, match="critics has 1 entries but there are 2 agents"):
        iac(agents=dirs, tokenizer=toks, critics=dirs[:1])
    with pytest.raises(ValueError, match="use_separate_critic=True"):
        iac(agents=dirs, tokenizer=toks)
    with pytest.raises(ValueError, match="critic_model and critics conflict"):
        iac(agents=dirs, tokenizer=toks, critic_model=dirs[0], critics=dirs)


def test_iac_separate_critic_must_match_its_actors_vocabulary(tiny_models):
    dirs = [tiny_models["qwen2-tiny"], tiny_models["llama-other-vocab"]]
    toks = [AutoTokenizer.from_pretrained(d) for d in dirs]
    with pytest.raises(ValueError, match="critic 1 .* different vocabulary than agent 1's tokenizer"):
        iac(agents=dirs, tokenizer=toks, critics=[dirs[0], dirs[0]])
    with pytest.raises(ValueError, match="critic 0 .* has 384 embedding rows"):
        iac(agents=dirs, tokenizer=toks, critics=[dirs[1], dirs[1]])


def test_iac_shared_critic_takes_no_critic_arguments(tiny_models):
    d = tiny_models["qwen2-tiny"]
    for kwargs in ({"critic_model": d}, {"critics": [d, d]}):
        with pytest.raises(ValueError, match="critic_model and critics must be unset .*use_separate_critic=False"):
            iac(separate=False, agent_model=d, **kwargs)
    plan = iac(separate=False, agent_model=d)
    agents = load_agents(plan, CPU, value_head=True, value_head_hidden_dim=4)
    assert agents[1].value_head.pre_projection[0].out_features == 4
    assert plan.critic_sources == []


def test_magrpo_has_no_critic(tiny_models):
    with pytest.raises(ValueError, match="this algorithm has no critic"):
        marlhf(agent_model=tiny_models["qwen2-tiny"], critic_model=tiny_models["qwen2-tiny"])


def test_marlhf_critic_sources(tiny_models, objects):
    d = tiny_models["qwen2-tiny"]
    assert marlhf(agent_model=d, critic_layout="central").critic_sources == [d]
    named = marlhf(agent_model=d, critic_layout="separate", critic_model_name=tiny_models["llama-tiny"])
    assert named.critic_sources == [tiny_models["llama-tiny"]] * 2
    explicit = marlhf(agent_model=d, critic_layout="central", critics=[tiny_models["qwen2-small"]],
                      critic_model_name=tiny_models["llama-tiny"])
    assert explicit.critic_sources == [tiny_models["qwen2-small"]]
    with pytest.raises(ValueError, match="set MARLHFConfig.critic_model_name"):
        marlhf(agents=[nameless(objects["qwen"])], tokenizer=objects["tok"], critic_layout="central",
               reward_model_name=d)


# ---- reward model ----------------------------------------------------------------------------------

def test_reward_model_source_defaults_to_agent_zero(tiny_models, objects):
    assert marlhf(agent_model=tiny_models["qwen2-tiny"]).reward_model_source == tiny_models["qwen2-tiny"]
    plan = marlhf(agents=[objects["llama"], objects["qwen"]], tokenizer=objects["tok"])
    assert plan.reward_model_source == tiny_models["llama-tiny"]
    explicit = marlhf(agent_model=tiny_models["qwen2-tiny"], reward_model_name=tiny_models["llama-other-vocab"])
    assert explicit.reward_model_source == tiny_models["llama-other-vocab"]


def test_reward_model_name_required_for_nameless_objects(objects, tmp_path):
    with pytest.raises(ValueError, match="MARLHFConfig.reward_model_name is required"):
        marlhf(agents=[nameless(objects["qwen"])], tokenizer=objects["tok"])
    with pytest.raises(ValueError, match="MARLHFConfig.reward_model_name=.*does not exist"):
        marlhf(agents=[objects["qwen"]], tokenizer=objects["tok"], reward_model_name=str(tmp_path / "missing"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_default_cuda_reward_device_fails_at_construction_on_cpu(tiny_models):
    with pytest.raises(ValueError, match=r"reward_model_device='cuda:0' is not available.*reward_model_device=None.*'cpu'"):
        marlhf(agent_model=tiny_models["qwen2-tiny"], reward_model_device="cuda:0")


def test_reward_model_device_values(tiny_models):
    d = tiny_models["qwen2-tiny"]
    assert marlhf(agent_model=d, reward_model_device=None).reward_model_device is None
    assert marlhf(agent_model=d, reward_model_device="cpu").reward_model_device == CPU
    with pytest.raises(ValueError, match="reward_model_device='gpu0' is not a device"):
        marlhf(agent_model=d, reward_model_device="gpu0")


def test_reward_model_loads_with_its_own_tokenizer(tiny_models):
    plan = marlhf(agent_model=tiny_models["qwen2-tiny"], reward_model_name=tiny_models["llama-other-vocab"])
    model, tokenizer = load_reward_model(plan, CPU, freeze_backbone=True)
    assert len(tokenizer) == 384
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["reward_head.weight", "reward_head.bias"]


# ---- model_config ----------------------------------------------------------------------------------

def test_model_config_is_validated_up_front(tiny_models):
    d = tiny_models["qwen2-tiny"]
    with pytest.raises(ValueError, match=r"model_config has unknown keys \['dtyp'\]"):
        magrpo(agent_model=d, model_config={"dtyp": "bfloat16"})
    with pytest.raises(ValueError, match="model_config\\['dtype'\\]='bf16'"):
        magrpo(agent_model=d, model_config={"dtype": "bf16"})
    plan = magrpo(agent_model=d, num_agents=1, model_config={"dtype": "bfloat16"})
    assert next(load_agents(plan, CPU)[0].parameters()).dtype == torch.bfloat16
