"""Run one benchmark case with ``comlrl_core``: ``python -m benchmarks.ours_case '<case json>'``.

Prints one ``RESULT {json}`` line (see :mod:`benchmarks.measure`). A fresh process per case, so its
peak memory is its own.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import sys
import time

from benchmarks.measure import Meter, result, setup
from comlrl_core import rollout
from comlrl_core.environments import length_ratio_dataset, length_ratio_reward
from comlrl_core.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl_core.trainers.preference import MARLHFConfig, MARLHFTrainer
from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

_TRAINERS = {"magrpo": (MAGRPOTrainer, MAGRPOConfig), "iac": (IACTrainer, IACConfig),
             "maac": (MAACTrainer, MAACConfig), "marlhf": (MARLHFTrainer, MARLHFConfig)}


def build(case: dict):
    s = case["settings"]
    trainer_class, config_class = _TRAINERS[case["trainer"]]
    config = dict(num_agents=s["num_agents"], num_generations=s["num_generations"],
                  max_new_tokens=s["max_new_tokens"], temperature=s["temperature"], top_p=s["top_p"],
                  top_k=s["top_k"], agent_learning_rate=s["learning_rate"], num_train_epochs=s["epochs"],
                  rollout_buffer_size=s["rollout_buffer_size"], eval_num_samples=s["eval_items"], eval_interval=0,
                  seed=s["seed"], verbose=False)
    entities = {}
    agents = case["agents"]
    if len(set(agents)) == 1:
        entities["agent_model"] = agents[0]
    else:
        entities["agents"] = agents
    if case["trainer"] in ("iac", "maac"):
        config["critic_learning_rate"] = s["critic_learning_rate"]
    if case["trainer"] == "iac":
        config["use_separate_critic"] = case["critic_mode"] == "separate"
        if case.get("critic"):
            entities["critic_model"] = case["critic"]
    if case["trainer"] == "maac":
        entities["critic_model"] = case["critic"]
    if case["trainer"] == "marlhf":
        config.update(reward_model_name=case["reward_model"], reward_model_device="cpu",
                      **{k: s[k] for k in ("preference_num_candidates", "preference_pairs_per_sample",
                                           "reward_learning_rate", "reward_num_train_epochs",
                                           "reward_train_batch_size")})
    if "agents" in entities and case["trainer"] != "magrpo":
        entities["tokenizer"] = None  # each agent directory's own tokenizer
    return trainer_class(**entities, reward_func=length_ratio_reward,
                         train_dataset=length_ratio_dataset(s["train_items"]),
                         eval_dataset=length_ratio_dataset(s["eval_items"], offset=s["train_items"]),
                         args=config_class(**config))


# Where a step's time goes: label -> the functions (file suffix, name) whose cumulative time it is.
# The first six do not overlap; the rest are parts of them.
_PARTS = {
    "generate": [("comlrl_core/rollout.py", "generate_ids")],
    "policy update": [("reinforce/magrpo.py", "_update"), ("actor_critic/base.py", "_update_actor")],
    "critic update": [("actor_critic/base.py", "_update_critic")],
    "reward-model fit": [("preference/marlhf.py", "fit_reward_model")],
    "reward function": [("comlrl_core/rewards.py", "__call__")],
    "tokenize/decode": [("tokenization_utils_base.py", "__call__"), ("tokenization_utils_base.py", "batch_decode")],
    "backward (in updates and fit)": [("torch/_tensor.py", "backward")],
    "optimizer step (in updates and fit)": [("torch/optim/optimizer.py", "wrapper")],
    "preference collection (its generate included)": [("preference/marlhf.py", "collect_preferences")],
}
_TOP_LEVEL = 6


def breakdown(profile: cProfile.Profile, total: float) -> dict:
    """Share of the training time in each part (cumulative time of its functions), and the rest."""
    stats = pstats.Stats(profile).stats

    def seconds(functions) -> float:
        return sum(ct for (file, _, name), (_, _, _, ct, _) in stats.items()
                   if any(file.endswith(suffix) and name == function for suffix, function in functions))

    shares = {label: round(seconds(functions) / total, 3) for label, functions in _PARTS.items()}
    shares["other (rollout bookkeeping, critic values, Python)"] = round(
        1 - sum(list(shares.values())[:_TOP_LEVEL]), 3)
    return shares


def run(case: dict) -> dict:
    s = case["settings"]
    setup(s["threads"], s["seed"])
    trainer = build(case)
    meter = Meter(rollout, "generate_ids")
    before = trainer.evaluate()["eval/turn_1/reward_mean"]
    meter.reset()
    profile = cProfile.Profile() if os.environ.get("BENCH_PROFILE") == "1" else None
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    trainer.train()
    seconds = time.perf_counter() - start
    figures = result(case, "ours", meter, seconds, s["train_items"] * s["epochs"], round(before, 4), None)
    if profile is not None:
        profile.disable()
        figures["profile"] = breakdown(profile, seconds)
    figures["eval_after"] = round(trainer.evaluate()["eval/turn_1/reward_mean"], 4)
    return figures


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
