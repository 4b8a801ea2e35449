"""MAGRPO: the seed's examples, learning, multi-turn returns, data, export and config validation."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl_core.checkpoint import CheckpointError, verify_dir
from helpers import reward_rise

from comlrl_core.environments import length_ratio_dataset, length_ratio_reward
from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def small_config(**overrides):
    base = dict(num_train_epochs=1, max_new_tokens=6, num_generations=3, agent_learning_rate=1e-3,
                verbose=False, rollout_buffer_size=1)
    return MAGRPOConfig(**{**base, **overrides})


def weights(trainer):
    return [{k: v.clone() for k, v in a.state_dict().items()} for a in trainer.agents]


def same(a, b):
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_seed_homogeneous_example(tiny_models):
    # The seed's example with "Qwen/Qwen2.5-1.5B" replaced by a local directory.
    reward_func = lambda a, b, c: [float(len(x) + len(y) - len(z)) for x, y, z in zip(a, b, c)]  # noqa: E731
    train_dataset = [{"prompt": "Write about cats:"}]
    trainer = MAGRPOTrainer(
        agent_model=tiny_models["qwen2-tiny"],
        agents=None,
        num_agents=3,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MAGRPOConfig(num_agents=3, num_turns=1, temperature=0.7, top_p=0.9, top_k=None),
    )
    before = weights(trainer)
    trainer.train()
    assert trainer.num_agents == 3 and trainer.progress.epoch == 20
    assert not same(before, weights(trainer))


def test_seed_heterogeneous_example_then_save_and_continue(tiny_models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the seed writes ./saved-models/...
    reward_func = length_ratio_reward
    train_dataset = length_ratio_dataset(1)
    trainer = MAGRPOTrainer(
        agent_model=None,
        agents=[tiny_models["qwen2-tiny"], tiny_models["llama-other-vocab"]],
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MAGRPOConfig(num_agents=2, num_turns=1, temperature=0.7, top_p=0.9, top_k=None),
    )
    trainer.train()
    trainer.save_model("./saved-models/run-1")

    continued_trainer = MAGRPOTrainer(
        agents=["./saved-models/run-1/agent_0", "./saved-models/run-1/agent_1"],
        num_agents=2,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MAGRPOConfig(num_agents=2, num_turns=1, num_train_epochs=3,
                          agent_learning_rate=5e-6, temperature=0.7, top_p=0.9, top_k=None),
    )
    assert same(weights(trainer), weights(continued_trainer))
    assert len(continued_trainer.tokenizers[1]) == 384
    continued_trainer.train()
    assert continued_trainer.progress.epoch == 3  # three *new* epochs
    assert continued_trainer.progress.env_step == 3 * 4
    continued_trainer.save_model("./saved-models/run-2")
    for run in ("run-1", "run-2"):
        manifest = verify_dir(tmp_path / "saved-models" / run)
        assert sorted({f.split("/")[0] for f in manifest["files"]}) == ["agent_0", "agent_1"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved-models/run-2/agent_1")
    assert torch.equal(reloaded.lm_head.weight, continued_trainer.agents[1].lm_head.weight)


def test_gradients_left_before_train_are_not_added_in_and_none_are_kept(tiny_models):
    def trained(stale: bool):
        trainer = MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], num_agents=2, reward_func=length_ratio_reward,
                                train_dataset=length_ratio_dataset(2), args=small_config(num_agents=2))
        if stale:
            for p in trainer.agents[0].parameters():
                p.grad = torch.ones_like(p)
        trainer.train()
        assert all(p.grad is None for a in trainer.agents for p in a.parameters())  # freed at each step
        return weights(trainer)

    assert same(trained(stale=False), trained(stale=True))


def test_mean_reward_rises_on_the_cooperative_task(tiny_models):
    trainer = MAGRPOTrainer(
        agent_model=tiny_models["qwen2-tiny"], num_agents=2, reward_func=length_ratio_reward,
        train_dataset=length_ratio_dataset(6),
        args=MAGRPOConfig(num_train_epochs=8, max_new_tokens=16, num_generations=6, agent_learning_rate=1e-2,
                          rollout_buffer_size=1, temperature=1.0, top_p=1.0, top_k=None, verbose=False),
    )
    trainer.train()
    first, last = reward_rise(trainer.history)
    print(f"mean reward first quarter {first:.3f} -> last quarter {last:.3f}")
    assert last > first + 0.1


def test_multi_turn_tree_applies_the_discount(tiny_models):
    calls = []

    def transition(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        calls.append([len(h) for h in response_history_per_agent])
        return [f"{prompt} again {i}" for i in range(num_agents)]

    trainer = MAGRPOTrainer(
        agent_model=tiny_models["qwen2-tiny"], num_agents=2, reward_func=lambda a, b: [1.0] * len(a),
        train_dataset=[{"prompt": "Write about cats:"}], external_transition=transition,
        args=small_config(num_turns=3, discount=0.5, num_generations=2),
    )
    trainer.train()
    assert len(calls) == 2 + 4  # aligned tree: 2 children of the root, 2 of each child
    assert calls[0] == [1, 1] and calls[-1] == [2, 2]
    metrics = trainer.history[-2] if "turn_1/expected_return" not in trainer.history[-1] else trainer.history[-1]
    assert metrics["turn_1/expected_return"] == pytest.approx(1 + 0.5 * (1 + 0.5))
    assert metrics["turn_3/expected_return"] == pytest.approx(1.0)
    assert trainer.progress.env_step == 2 + 4 + 8


def test_multi_turn_needs_a_transition(tiny_models):
    with pytest.raises(ValueError, match="num_turns=2 needs an external_transition"):
        MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], reward_func=length_ratio_reward,
                      args=small_config(num_turns=2))


def test_cross_mode_scores_every_combination(tiny_models):
    seen = []

    def reward(a, b, *, batch_items=None):
        seen.append((len(a), batch_items[0]["topic"]))
        return [float(len(x) > len(y)) for x, y in zip(a, b)]

    trainer = MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], reward_func=reward,
                            train_dataset=length_ratio_dataset(1), args=small_config(joint_mode="crossed"))
    assert trainer.args.joint_mode == "cross"
    trainer.train()
    assert seen == [(9, "cats")]
    assert trainer.progress.env_step == 9


def test_iterable_and_hf_datasets_work(tiny_models):
    from datasets import Dataset

    hf = Dataset.from_list(length_ratio_dataset(3))
    for data in (hf, hf.to_iterable_dataset()):
        trainer = MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], reward_func=length_ratio_reward,
                                train_dataset=data, args=small_config(num_train_epochs=2))
        trainer.train()
        assert trainer.progress.items_done == 6


def test_data_order_is_shuffled_reproducibly(tiny_models):
    orders = []
    for shuffle in (True, True, False):
        topics = []
        trainer = MAGRPOTrainer(
            agent_model=tiny_models["qwen2-tiny"], train_dataset=length_ratio_dataset(8),
            reward_func=lambda a, b, *, batch_items: topics.append(batch_items[0]["topic"]) or [0.0] * len(a),
            args=small_config(num_train_epochs=2, shuffle=shuffle))
        trainer.train()
        orders.append(topics)
    assert orders[0] == orders[1]
    assert orders[0][:8] != orders[0][8:]  # a new order every epoch
    assert orders[2][:8] == orders[2][8:] == [d["topic"] for d in length_ratio_dataset(8)]


def test_evaluation_uses_its_own_fixed_seed(tiny_models):
    trainer = MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], reward_func=length_ratio_reward,
                            train_dataset=length_ratio_dataset(2), eval_dataset=length_ratio_dataset(3, offset=6),
                            args=small_config(eval_num_samples=2))
    torch.manual_seed(1)
    state = torch.get_rng_state()
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first == second and set(first) == {"eval/turn_1/reward_mean", "eval/turn_1/expected_return"}
    assert torch.equal(torch.get_rng_state(), state)
    trainer.args.eval_num_samples = 0
    assert trainer.evaluate() == {}


def test_eval_logger_and_aggregator(tiny_models):
    def eval_logger(agent_completions_turns, batch_items, prompts):
        return [{"answer_chars": len(agent_completions_turns[0][n][0])} for n in range(len(batch_items))]

    def eval_aggregator(metrics, num_turns):
        return {"turn_1/answer_chars": sum(m["answer_chars"] for m in metrics) / len(metrics)}

    trainer = MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], reward_func=length_ratio_reward,
                            eval_dataset=length_ratio_dataset(2), eval_logger=eval_logger,
                            eval_aggregator=eval_aggregator, args=small_config())
    assert "eval/turn_1/answer_chars" in trainer.evaluate()
    with pytest.raises(ValueError, match="eval_logger and eval_aggregator go together"):
        MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], reward_func=length_ratio_reward,
                      eval_logger=eval_logger, args=small_config())


def test_non_finite_reward_stops_training(tiny_models):
    trainer = MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], reward_func=lambda a, b: [math.nan] * len(a),
                            train_dataset=length_ratio_dataset(1), args=small_config())
    with pytest.raises(FloatingPointError, match="non-finite reward"):
        trainer.train()


def test_train_needs_a_dataset_and_valid_checkpoint_arguments(tiny_models):
    trainer = MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], reward_func=length_ratio_reward, args=small_config())
    with pytest.raises(ValueError, match="requires a train_dataset"):
        trainer.train()
    trainer.train_dataset = length_ratio_dataset(1)
    for kwargs, field in (({"checkpoint_interval": 0}, "checkpoint_interval"),
                          ({"checkpoint_steps": True}, "checkpoint_steps"),
                          ({"num_return_sequences": 2}, "num_return_sequences")):
        with pytest.raises(ValueError, match=field):
            trainer.train(**kwargs)


def test_reference_kl_shapes_the_returns(tiny_models):
    trainer = MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], reward_func=length_ratio_reward,
                            train_dataset=length_ratio_dataset(2),
                            args=small_config(num_train_epochs=2, reference_kl_enabled=True, agent_learning_rate=5e-2))
    trainer.train()
    kls = [h["reference_kl_mean"] for h in trainer.history if "reference_kl_mean" in h]
    assert kls[0] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert kls[-1] > 0


def test_save_model_refuses_a_foreign_directory_and_replaces_its_own_export(tiny_models, tmp_path):
    trainer = MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], reward_func=length_ratio_reward,
                            args=small_config())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a previous export"):
        trainer.save_model(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    out = trainer.save_model(tmp_path / "export")
    trainer.save_model(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["export"]["trainer_class"].endswith("MAGRPOTrainer")
    assert manifest["export"]["sources"] == [tiny_models["qwen2-tiny"]] * 2
    assert AutoTokenizer.from_pretrained(out / "agent_1").get_vocab() == trainer.tokenizers[1].get_vocab()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("overrides, field", [
    ({"num_generations": 1}, "num_generations"),
    ({"joint_mode": "diagonal"}, "joint_mode"),
    ({"top_p": 0.0}, "top_p"),
    ({"agent_learning_rate": float("nan")}, "agent_learning_rate"),
    ({"discount": 1.5}, "discount"),
    ({"advantage_mode": "median"}, "advantage_mode"),
    ({"num_train_epochs": 0}, "num_train_epochs"),
    ({"shuffle": "yes"}, "shuffle"),
])
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"MAGRPOConfig.{field}"):
        MAGRPOConfig(**overrides)


def test_config_defaults_avoid_the_reference_traps():
    config = MAGRPOConfig()
    assert config.num_turns == 1 and config.early_termination_threshold is None
    assert config.train_batch_size == config.rollout_buffer_size
    assert MAGRPOConfig(advantage_mode="RLOO", joint_mode="align").advantage_mode == "rloo"


def test_items_before_an_update_are_sampled_together_and_draw_what_they_draw_alone(tiny_models, monkeypatch, tmp_path):
    """With ``rollout_buffer_size=3`` the items before each update sample their first turn in one
    call per agent (a checkpoint every 2 items cuts those windows); each item draws from its own
    stream, so the run trains exactly as one that samples item by item."""
    from comlrl_core import rollout

    calls = []
    original = rollout.generate_ids

    def counting(model, prompts, *args, **kwargs):
        calls.append(len(prompts))
        return original(model, prompts, *args, **kwargs)

    monkeypatch.setattr(rollout, "generate_ids", counting)

    def run(tmp, one_by_one: bool):
        if one_by_one:
            monkeypatch.setattr(MAGRPOTrainer, "_items_until_update", lambda self: 1)
        trainer = MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], num_agents=2, reward_func=length_ratio_reward,
                                train_dataset=length_ratio_dataset(7),
                                args=small_config(rollout_buffer_size=3, num_train_epochs=2))
        calls.clear()
        trainer.train(checkpoint_dir=tmp, checkpoint_steps=2)
        rewards = [m["turn_1/reward_mean"] for m in trainer.history if "turn_1/reward_mean" in m]
        return weights(trainer), rewards, list(calls)

    together, rewards, calls_together = run(tmp_path / "a", False)
    alone, rewards_alone, calls_alone = run(tmp_path / "b", True)
    assert calls_alone == [1] * 28  # 7 items x 2 agents x 2 epochs
    # Windows end where the buffer fills (3 samples) or a checkpoint falls (every 2 items of the run):
    # epoch 1 [0 1] [2] [3] [4 5] [6], epoch 2 (items 8-14 of the run) [0] [1 2] [3 4] [5] [6]; 2 agents each.
    assert calls_together == [2, 2, 1, 1, 1, 1, 2, 2, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1]
    assert rewards == rewards_alone
    assert same(together, alone)


def test_evaluation_samples_its_items_together_as_each_alone(tiny_models, monkeypatch):
    """Every eval item's turn is one sampling call per agent, each item from its own seed: the same
    completions and rewards as one call per item."""
    from comlrl_core.trainers import base

    logged = []

    def eval_logger(agent_completions_turns, **_):
        logged.append(agent_completions_turns)
        return []

    trainer = MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], num_agents=2, reward_func=length_ratio_reward,
                            train_dataset=length_ratio_dataset(2), eval_dataset=length_ratio_dataset(5, offset=6),
                            eval_logger=eval_logger,
                            eval_aggregator=lambda per_item, num_turns: {},
                            args=small_config(eval_num_samples=5))
    together = trainer.evaluate()
    monkeypatch.setattr(base, "ROWS_PER_CALL", 1)
    assert trainer.evaluate() == together
    assert logged[0] == logged[1] and len(logged[0][0]) == 5
