"""MARLHF and MARLHFIter: stages, the learned reward model, exports, stage-by-stage exact resume."""

import json
import math
import random

import pytest
import torch
from helpers import reward_rise

from comlrl_core.checkpoint import verify_dir
from comlrl_core.environments import length_ratio_dataset, length_ratio_reward
from comlrl_core.trainers.preference import (
    MARLHFConfig,
    MARLHFIterConfig,
    MARLHFIterTrainer,
    MARLHFTrainer,
    PreferenceSet,
)
from comlrl_core.utils import read_checkpoint_metadata


def small(config_class=MARLHFConfig, **overrides):
    base = dict(num_agents=2, reward_model_device=None, preference_num_candidates=6, preference_pairs_per_sample=4,
                reward_learning_rate=1e-3, reward_train_batch_size=4, num_train_epochs=1, max_new_tokens=6,
                num_generations=2, agent_learning_rate=1e-3, rollout_buffer_size=1, verbose=False)
    return config_class(**{**base, **overrides})


def build(tiny_models, trainer_class=MARLHFTrainer, items=3, **overrides):
    config_class = MARLHFIterConfig if trainer_class is MARLHFIterTrainer else MARLHFConfig
    return trainer_class(agent_model=tiny_models["qwen2-tiny"], reward_func=length_ratio_reward,
                         train_dataset=length_ratio_dataset(items), args=small(config_class, **overrides))


def weights(trainer):
    modules = [*trainer.agents, *trainer.critics] + ([trainer.reward_model] if trainer.reward_model else [])
    return [{k: v.clone() for k, v in m.state_dict().items()} for m in modules]


def identical(a, b):
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_seed_marlhf_example_on_cpu(tiny_models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reward_func = length_ratio_reward
    train_dataset = length_ratio_dataset(1)
    trainer = MARLHFTrainer(
        agent_model=tiny_models["qwen2-tiny"],
        num_agents=2,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MARLHFConfig(num_agents=2, num_turns=1,
                          reward_model_name=tiny_models["llama-tiny"],
                          reward_model_device="cpu"),
    )
    trainer.train()
    assert trainer.reward_model.backbone.config.model_type == "llama"
    assert len(trainer.preferences.records) == 16
    assert list(tmp_path.iterdir()) == []  # nothing written to the working directory


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_default_reward_device_fails_at_construction(tiny_models):
    with pytest.raises(ValueError, match="reward_model_device='cuda:0' is not available.*None.*'cpu'"):
        MARLHFTrainer(agent_model=tiny_models["qwen2-tiny"], reward_func=length_ratio_reward,
                      args=MARLHFConfig(num_agents=2))


@pytest.mark.parametrize("seed", [0, 1])
def test_reward_model_beats_chance_on_held_out_prompts(tiny_models, seed):
    trainer = build(tiny_models, items=12, seed=seed, preference_num_candidates=16, preference_pairs_per_sample=32,
                    reward_model_name=tiny_models["llama-tiny"], reward_num_train_epochs=6, reward_eval_fraction=0.25,
                    max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=None)
    torch.manual_seed(seed)  # the stages run outside train(), which would seed them
    random.seed(seed)
    trainer.collect_preferences()
    metrics = trainer.fit_reward_model()
    n, accuracy = metrics["reward_model/heldout_pairs"], metrics["reward_model/heldout_accuracy"]
    correct = round(accuracy * n)
    p_value = sum(math.comb(n, k) for k in range(correct, n + 1)) / 2 ** n  # one-sided binomial test vs 0.5
    print(f"held-out pair accuracy {accuracy:.3f} on {n} pairs (p={p_value:.4f})")
    assert n >= 48 and p_value < 0.05


@pytest.mark.parametrize("rl_algorithm", ["magrpo", "maac"])
def test_policy_reward_under_the_learned_model_rises(tiny_models, tmp_path, rl_algorithm):
    trainer = MARLHFTrainer(
        agent_model=tiny_models["qwen2-tiny"], reward_func=length_ratio_reward, train_dataset=length_ratio_dataset(6),
        eval_dataset=length_ratio_dataset(2, offset=6),
        args=small(rl_algorithm=rl_algorithm, critic_model_name=tiny_models["llama-tiny"], preference_num_candidates=12,
                   preference_pairs_per_sample=16, reward_num_train_epochs=3, num_train_epochs=8, max_new_tokens=16,
                   num_generations=6 if rl_algorithm == "magrpo" else 4, agent_learning_rate=1e-2,
                   rollout_buffer_size=1 if rl_algorithm == "magrpo" else 4, critic_value_head_hidden_dim=8,
                   temperature=1.0, top_p=1.0, top_k=None, eval_interval=3, eval_num_samples=2))
    trainer.train()
    first, last = reward_rise(trainer.history, "learned/turn_1/reward_mean")
    assert not any("turn_1/reward_mean" in h for h in trainer.history)  # the learned score is named apart
    print(f"{rl_algorithm}: learned reward first quarter {first:.3f} -> last quarter {last:.3f}")
    assert last > first + 0.2
    assert any("eval/turn_1/reward_mean" in h for h in trainer.history)  # evaluation uses the task reward
    manifest = verify_dir(trainer.save_model(tmp_path / "out"))
    dirs = {f.split("/")[0] for f in manifest["files"]}
    assert {"agent_0", "agent_1", "reward_model"} <= dirs
    assert "reward_model/reward_head.pt" in manifest["files"]
    assert manifest["export"]["reward_model"]["source"] == tiny_models["qwen2-tiny"]
    if rl_algorithm == "maac":
        assert "critic/value_head.pt" in manifest["files"]
        assert trainer.critics[0].value_head.hidden_dim == 8  # the reference dropped this for MAAC
        assert trainer.critics[0].config.model_type == "llama"  # critic_model_name


def test_stages_are_callable_and_preferences_inspectable(tiny_models, tmp_path):
    trainer = build(tiny_models, preference_output_dir=str(tmp_path / "prefs"))
    with pytest.raises(ValueError, match="run collect_preferences"):
        trainer.fit_reward_model()
    prefs = trainer.collect_preferences()
    record = prefs.records[0]
    assert record["winner_reward"] > record["loser_reward"] and len(record["winner_completions"]) == 2
    saved = tmp_path / "prefs" / "preferences-iteration-0001.jsonl"
    assert PreferenceSet.load(saved).fingerprint == prefs.fingerprint
    meta = json.loads((tmp_path / "prefs" / "preferences-iteration-0001.meta.json").read_text())
    assert meta["num_pairs"] == len(prefs.records) == 12
    saved.write_text(saved.read_text().replace("Write", "Wrote", 1))
    with pytest.raises(ValueError, match="does not match the fingerprint"):
        PreferenceSet.load(saved)
    metrics = trainer.fit_reward_model(prefs)
    assert 0.0 <= metrics["reward_model/train_accuracy"] <= 1.0
    assert all(p.grad is None for p in trainer.reward_model.parameters())  # freed at each step
    assert trainer.score(["a", "b"]).shape == (2,)


def test_ties_everywhere_is_an_error(tiny_models):
    trainer = MARLHFTrainer(agent_model=tiny_models["qwen2-tiny"], reward_func=lambda a, b: [1.0] * len(a),
                            train_dataset=length_ratio_dataset(2), args=small())
    with pytest.raises(ValueError, match="every candidate tied"):
        trainer.train()


def test_marlhf_resume_stage_by_stage_is_bit_identical(tiny_models, tmp_path):
    full = build(tiny_models, num_train_epochs=2)
    full.train(checkpoint_dir=tmp_path / "ck")
    stages = {n: json.loads((tmp_path / "ck" / f"checkpoint-{n}" / "checkpoint.json").read_text())["progress"]["stage"]
              for n in range(1, 5)}
    assert stages == {1: "fit", 2: "policy", 3: "policy", 4: "policy"}  # after collection, after the fit, epochs
    assert not (tmp_path / "ck" / "checkpoint-1" / "reward_model").exists()
    assert (tmp_path / "ck" / "checkpoint-2" / "reward_model" / "0.safetensors").is_file()
    for sequence in range(1, 5):
        resumed = build(tiny_models, num_train_epochs=2)
        resumed.train(resume_from_checkpoint=tmp_path / "ck" / f"checkpoint-{sequence}")
        assert identical(weights(full), weights(resumed)), f"checkpoint-{sequence}"
        assert resumed.preferences.fingerprint == full.preferences.fingerprint


def test_marlhf_iter_reloads_the_reward_model_and_resumes_exactly(tiny_models, tmp_path):
    full = build(tiny_models, MARLHFIterTrainer, num_iterations=2, num_train_epochs=1)
    loads = []
    original = full._init_reward_model
    full._init_reward_model = lambda: (loads.append(full.progress.iteration), original())[1]
    full.train(checkpoint_dir=tmp_path / "ck")
    assert loads == [0, 1]  # a fresh reward model from its source every iteration
    assert {r["iteration"] for r in full.preferences.records} == {1}  # collected with the current policy
    metas = [read_checkpoint_metadata(tmp_path / "ck" / f"checkpoint-{n}") for n in range(1, 7)]
    assert [m["sequence"] for m in metas] == list(range(1, 7))
    for sequence in (1, 3, 4, 5):
        resumed = build(tiny_models, MARLHFIterTrainer, num_iterations=2, num_train_epochs=1)
        resumed.train(resume_from_checkpoint=tmp_path / "ck" / f"checkpoint-{sequence}")
        assert identical(weights(full), weights(resumed)), f"checkpoint-{sequence}"
    more = build(tiny_models, MARLHFIterTrainer, num_iterations=3, num_train_epochs=1)
    more.train(resume_from_checkpoint=tmp_path / "ck" / "checkpoint-6")
    assert more.progress.iteration == 3 and {r["iteration"] for r in more.preferences.records} == {2}


def test_resumed_preference_output_goes_to_a_resume_directory(tiny_models, tmp_path):
    out = tmp_path / "prefs"
    build(tiny_models, preference_output_dir=str(out)).train(checkpoint_dir=tmp_path / "ck")
    assert sorted(p.name for p in out.iterdir()) == ["preferences-iteration-0001.jsonl",
                                                     "preferences-iteration-0001.meta.json"]
    resumed = build(tiny_models, preference_output_dir=str(out))
    resumed.train(resume_from_checkpoint=tmp_path / "ck" / "checkpoint-1")  # collection is done: nothing new
    assert len(list(out.iterdir())) == 2
    again = build(tiny_models, MARLHFIterTrainer, num_iterations=1, preference_output_dir=str(out))
    again.train(checkpoint_dir=tmp_path / "ck-iter")
    subdirs = [p for p in out.iterdir() if p.is_dir()]
    assert len(subdirs) == 1 and subdirs[0].name.startswith("run-")
    later = build(tiny_models, MARLHFIterTrainer, num_iterations=2, preference_output_dir=str(out))
    later.train(resume_from_checkpoint=tmp_path / "ck-iter" / "checkpoint-3")
    resumed_dirs = [p for p in out.iterdir() if p.name.startswith("resume-")]
    assert len(resumed_dirs) == 1
    assert [p.name for p in resumed_dirs[0].iterdir() if p.suffix == ".jsonl"] == ["preferences-iteration-0002.jsonl"]


@pytest.mark.parametrize("overrides, field", [
    ({"rl_algorithm": "ppo"}, "rl_algorithm"),
    ({"joint_mode": "cross"}, "joint_mode"),
    ({"num_turns": 2}, "num_turns"),
    ({"pair_selection": "all"}, "preference_pairs_per_sample"),
    ({"preference_num_candidates": 1}, "preference_num_candidates"),
    ({"reward_learning_rate": 0.0}, "reward_learning_rate"),
    ({"reward_eval_fraction": 1.0}, "reward_eval_fraction"),
    ({"rl_algorithm": "magrpo", "num_generations": 1}, "num_generations"),
])
def test_config_validation(overrides, field):
    with pytest.raises(ValueError, match=f"MARLHFConfig.{field}"):
        MARLHFConfig(**overrides)


def test_config_aliases_and_iter_defaults():
    assert MARLHFConfig(rl_algorithm="MAReinforce").rl_algorithm == "mareinforce"
    assert MARLHFConfig(rl_algorithm="iac", num_generations=1).backend == "iac"
    with pytest.raises(ValueError, match="MARLHFIterConfig.num_iterations"):
        MARLHFIterConfig(num_iterations=0)


def test_collection_samples_items_together_and_each_draws_what_it_draws_alone(tiny_models, monkeypatch):
    """Collection samples up to ``ROWS_PER_CALL`` candidate rows per call, several items at once, and
    each item draws from its own stream: the same pairs as sampling item by item."""
    from comlrl_core.trainers.preference import marlhf

    together = build(tiny_models, items=5).collect_preferences()
    monkeypatch.setattr(marlhf, "ROWS_PER_CALL", 1)  # one item per call
    alone = build(tiny_models, items=5).collect_preferences()
    assert together.records == alone.records and len(together.records) == 20
