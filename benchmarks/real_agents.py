"""Learning with real agents: ``python -m benchmarks.real_agents [--algorithm magrpo] [--seeds 0 1 2]``.

Runs ``comlrl-pipeline demo --real``'s spec (two SmolLM2-135M-Instruct agents on the writing task,
through the Prefect flow) once per seed, and prints for each the held-out reward before and after
training (the first and the last evaluation, the last on the exported models), the wall time, and
the machine; then the mean over seeds. Needs the ``[real]`` extra (see ``comlrl-pipeline models``).
Prints JSON lines and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{cpu or platform.machine()}, {os.cpu_count()} cores"


def _reward_model(metrics: dict) -> dict:
    """The learned reward model's held-out pair accuracy, for the preference trainers."""
    accuracy = metrics.get("reward_model_heldout_accuracy")
    return {} if accuracy is None else {"reward_model_heldout_accuracy": round(accuracy, 4)}


def main(argv: list[str] | None = None) -> int:
    from flows.cli import REAL_DEMO_CONFIGS

    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_agents", description=__doc__)
    parser.add_argument("--algorithm", choices=sorted(REAL_DEMO_CONFIGS), default="magrpo")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--items", type=int, default=None, help="training topics, one pass (default: the demo's)")
    parser.add_argument("--workdir", type=Path, default=None, help="model and runs (default: a temporary directory)")
    args = parser.parse_args(argv)
    os.environ.update(WANDB_MODE="disabled", PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1",
                      TRANSFORMERS_OFFLINE="1", PREFECT_LOGGING_LEVEL="WARNING")

    import torch
    from prefect.testing.utilities import prefect_test_harness

    from comlrl_core.real_models import make_real_model
    from flows.cli import _load_spec, real_demo_spec
    from flows.pipeline import train_pipeline

    work = args.workdir or Path(tempfile.mkdtemp(prefix="comlrl-bench-real-"))
    model = make_real_model("smollm2", work / "models" / "smollm2")
    rows = []
    with prefect_test_harness(server_startup_timeout=120):
        for seed in args.seeds:
            storage = str(work / "runs" / f"{args.algorithm}-seed-{seed}")
            spec = _load_spec(real_demo_spec(args.algorithm, model, storage, seed=seed, items=args.items))
            start = time.perf_counter()
            result = train_pipeline(spec)
            metrics = result["metrics"]
            row = {"algorithm": args.algorithm, "seed": seed, "items": spec.train_dataset.limit,
                   "metric": metrics["metric"], "before": round(metrics["before"], 4),
                   "after": round(metrics["after"], 4), **_reward_model(metrics),
                   "seconds": round(time.perf_counter() - start, 1), "machine": _machine(),
                   "torch": torch.__version__, "threads": torch.get_num_threads()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    before = statistics.mean(r["before"] for r in rows)
    after = statistics.mean(r["after"] for r in rows)
    print(f"\nheld-out reward of two SmolLM2-135M-Instruct agents, writing task, {args.algorithm}, "
          f"{rows[0]['items']} topics; {rows[0]['machine']}\n")
    print("| seed | before | after | change | wall time |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['before']:.3f} | {r['after']:.3f} | {r['after'] - r['before']:+.3f} | "
              f"{r['seconds'] / 60:.1f} min |")
    print(f"| mean | {before:.3f} | {after:.3f} | {after - before:+.3f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
