"""Run one benchmark case with the public reference library (``comlrl==1.4.3``), through its public API.

    <reference venv>/bin/python benchmarks/reference_case.py '<case json from benchmarks.cases.expand>'

Prints exactly one line on stdout, ``RESULT {json}`` (``benchmarks.measure.result``, impl "reference"),
or ``RESULT {"case", "impl", "error"}`` when the case cannot run on the reference; everything the library
prints goes to stderr. Runs in the reference's own venv: it imports ``comlrl`` and never ``comlrl_core``
(the task's dataset and reward come from ``comlrl_core/environments/length_ratio.py`` loaded by file path; that file
has no imports, so the package is not imported).

How the shared SETTINGS map onto the reference (section numbers are those of the reference's notes):

- num_agents: the trainer constructor's ``num_agents`` (MAGRPO/MARLHF, which ignore ``args.num_agents``,
  notes 14.13) and ``args.num_agents`` (IAC/MAAC, which only read the config).
- num_generations, max_new_tokens, temperature, top_p: the config fields of the same names.
- top_k: ``None`` in SETTINGS means "no top-k". The reference leaves generation's top_k unset when its
  config says ``None``, and transformers 5 then applies its global default of 50, so ``None`` is passed
  as ``top_k=0`` (transformers: 0 disables top-k), which is what our implementation does too.
- learning_rate -> ``agent_learning_rate``; critic_learning_rate -> ``critic_learning_rate`` (IAC, MAAC).
- epochs -> ``num_train_epochs``; single turn (``num_turns=1``); ``eval_num_samples = eval_items``;
  ``eval_interval=0`` so that train() does not evaluate (it would otherwise at the start of each epoch).
- rollout_buffer_size -> ``rollout_buffer_size`` for every trainer (the same field our implementation
  takes; MAGRPO/MARLHF count node samples, one per agent per prompt; IAC/MAAC count rollout samples,
  K per agent per prompt), ``train_batch_size`` left at its default (= rollout_buffer_size).
- seed: the reference has no seed anywhere in its configs (notes 14.27), so the process is seeded
  (``benchmarks.measure.setup``: torch; plus ``random`` and numpy, which its buffers shuffle with)
  before the trainer is built and again right before train(). threads: ``torch.set_num_threads``.
- Evaluation score: the mean of ``eval/turn_1/reward_mean`` from ``evaluate()`` (notes 3.6, 4.4, 9),
  the mean task reward over ``eval_items`` prompts, one sample per agent per prompt. Each evaluate()
  runs inside ``torch.random.fork_rng`` after ``torch.manual_seed(seed)``, as our implementation's
  evaluate does internally: before and after see the same sampling stream, and training's does not
  depend on evaluation.
- MARLHF: MAGRPO backend (``rl_algorithm="magrpo"``), the case's reward_model directory as
  ``reward_model_name``, ``reward_model_device="cpu"`` (the default ``"cuda:0"`` fails on a CPU machine
  only after preference collection, notes 14.4), and the preference settings of SETTINGS under the same
  names (preference_num_candidates, preference_pairs_per_sample, reward_learning_rate,
  reward_num_train_epochs, reward_train_batch_size). train() includes preference collection and
  reward-model training, so both count in the timing, the meter's generated tokens and its optimizer
  steps.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Before wandb/transformers are imported: no W&B login or network, nothing written to the repo.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MARLHF_PREFERENCES = ("preference_num_candidates", "preference_pairs_per_sample", "reward_learning_rate",
                      "reward_num_train_epochs", "reward_train_batch_size")
EVAL_KEY = "eval/turn_1/reward_mean"


def load_environment():
    """``comlrl_core/environments/length_ratio.py`` as a stand-alone module (it has no imports)."""
    path = ROOT / "comlrl_core" / "environments" / "length_ratio.py"
    spec = importlib.util.spec_from_file_location("_bench_length_ratio_environment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sampling(settings: dict) -> dict:
    top_k = settings["top_k"]
    return {"num_generations": settings["num_generations"], "max_new_tokens": settings["max_new_tokens"],
            "temperature": settings["temperature"], "top_p": settings["top_p"],
            "top_k": 0 if top_k is None else top_k}


def _common(settings: dict) -> dict:
    return {"num_agents": settings["num_agents"], "num_train_epochs": settings["epochs"],
            "agent_learning_rate": settings["learning_rate"], "num_turns": 1,
            "eval_interval": 0, "eval_num_samples": settings["eval_items"], "eval_batch_size": 1,
            "rollout_buffer_size": settings["rollout_buffer_size"],
            **_sampling(settings)}


def _agent_sources(case: dict) -> dict:
    """Homogeneous agents as ``agent_model`` (N loads of one directory); heterogeneous as ``agents``."""
    agents = case["agents"]
    if len(set(agents)) == 1:
        return {"agent_model": agents[0]}
    return {"agents": list(agents)}


def build_trainer(case: dict, train_data: list, eval_data: list, reward):
    from comlrl.trainers import (IACConfig, IACTrainer, MAACConfig, MAACTrainer, MAGRPOConfig, MAGRPOTrainer,
                                 MARLHFConfig, MARLHFTrainer)

    settings, kind = case["settings"], case["trainer"]
    common = _common(settings)
    data = {"train_dataset": train_data, "eval_dataset": eval_data, "reward_func": reward}
    if kind == "magrpo":
        args = MAGRPOConfig(**common)
        # MAGRPO loads one tokenizer per agent when none is given (notes 2.2), for either form.
        return MAGRPOTrainer(**_agent_sources(case), num_agents=settings["num_agents"], args=args, **data)
    if kind == "marlhf":
        args = MARLHFConfig(**common, rl_algorithm="magrpo", reward_model_name=case["reward_model"],
                            reward_model_device="cpu", **{k: settings[k] for k in MARLHF_PREFERENCES})
        return MARLHFTrainer(**_agent_sources(case), num_agents=settings["num_agents"], args=args, **data)
    ac = {**common, "critic_learning_rate": settings["critic_learning_rate"]}
    sources = _agent_sources(case)
    if "agents" in sources:
        # IAC/MAAC require tokenizers with ``agents`` (notes 2.3); one per agent directory.
        from transformers import AutoTokenizer
        sources["tokenizer"] = [AutoTokenizer.from_pretrained(d) for d in sources["agents"]]
    if kind == "iac":
        separate = case.get("critic_mode", "shared") == "separate"
        args = IACConfig(**ac, use_separate_critic=separate)
        critic = {"critic_model": case["critic"]} if separate else {}
        return IACTrainer(**sources, **critic, args=args, **data)
    if kind == "maac":
        args = MAACConfig(**ac)
        return MAACTrainer(**sources, critic_model=case["critic"], args=args, **data)
    raise ValueError(f"unknown trainer {kind!r}")


def _seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _score(trainer, seed: int) -> float | None:
    """``evaluate()`` sampled under a fixed seed, leaving the training random streams untouched."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        value = trainer.evaluate().get(EVAL_KEY)
    return None if value is None else round(float(value), 4)


def run(case: dict) -> dict:
    from benchmarks.measure import Meter, result, setup

    settings = case["settings"]
    env = load_environment()
    train_data = env.length_ratio_dataset(settings["train_items"], 0)
    eval_data = env.length_ratio_dataset(settings["eval_items"], settings["train_items"])

    def reward(answers, summaries):  # two positional parameters: called as f(c_0, c_1) (notes 1.3)
        return env.length_ratio_reward(answers, summaries)

    seed = settings["seed"]
    setup(settings["threads"], seed)
    _seed_all(seed)
    trainer = build_trainer(case, train_data, eval_data, reward)
    meter = Meter()
    before = _score(trainer, seed)
    _seed_all(seed)
    meter.reset()
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    figures = (meter.generate_seconds, meter.generated_tokens, meter.optimizer_steps)
    after = _score(trainer, seed)
    meter.generate_seconds, meter.generated_tokens, meter.optimizer_steps = figures
    items = settings["train_items"] * settings["epochs"]
    return result(case, "reference", meter, train_seconds, items, before, after)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: reference_case.py '<case json>'", file=sys.stderr)
        return 2
    case = json.loads(argv[0])
    stdout = sys.stdout
    workdir = tempfile.mkdtemp(prefix="bench-reference-")
    cwd = os.getcwd()
    os.environ.setdefault("WANDB_DIR", workdir)
    try:
        os.chdir(workdir)
        with contextlib.redirect_stdout(sys.stderr):
            line = run(case)
        if "comlrl_core" in sys.modules:  # the two implementations must stay apart
            raise RuntimeError("the reference runner imported comlrl_core")
    except Exception as exc:  # reported as the case's result, so the harness can show it
        import traceback

        traceback.print_exc(file=sys.stderr)
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        line = {"case": case.get("name"), "impl": "reference", "error": why}
    finally:
        os.chdir(cwd)
        shutil.rmtree(workdir, ignore_errors=True)
    print("RESULT " + json.dumps(line), file=stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
