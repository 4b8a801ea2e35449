"""Pipeline overhead: ``python -m benchmarks.pipeline [--size small] [--prompts N] [--epochs N] [--repeats N]``.

1. The same MAGRPO training called directly (``spec.build_trainer().train()``) and through the
   Prefect flow (one training stage, checkpointed at each epoch's end, that also exports its trained
   models, then the export task), on an API that is already running — what a deployment's worker
   sees. The default ``--prompts`` makes the direct run about a minute on one CPU thread; the two
   alternate ``--repeats`` times and the medians are compared.
2. The cost of a resume: the flow, now checkpointing every ``--checkpoint-steps`` steps, fails at
   its last step (the reward function raises once), then runs again. The re-run redoes the work
   since the last checkpoint; the rest of its time is the fixed cost of resuming (Prefect, loading
   the models and the checkpoint, the export), reported separately, as is the cost of one
   checkpoint (written, then stored and verified).
Prints JSON lines and a short Markdown summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _spec(models: dict, storage: str, prompts: int, epochs: int, reward: str, checkpoint_steps: int | None = None):
    from flows.cli import demo_spec
    from tasks.spec import RunSpec

    spec = demo_spec("magrpo", models, storage)
    spec["config"].update(num_train_epochs=epochs, eval_interval=0, max_new_tokens=16, num_generations=4)
    spec.update(stage_epochs=epochs, checkpoint_steps=checkpoint_steps, reward_func=reward, eval_dataset=None,
                train_dataset={"builtin": "length_ratio", "size": prompts})
    return RunSpec(**spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__)
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--prompts", type=int, default=100, help="prompts per epoch (one training step each)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs in the one training stage (each ends "
                        "with a checkpoint)")
    parser.add_argument("--checkpoint-steps", type=int, default=10,
                        help="checkpoint cadence (training steps) of the run that fails and resumes")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="direct/flow pairs, alternating order (median)")
    args = parser.parse_args(argv)
    os.environ.update(WANDB_MODE="disabled", PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1",
                      TRANSFORMERS_OFFLINE="1", PREFECT_LOGGING_LEVEL="WARNING")
    sys.path.insert(0, str(ROOT / "tests"))  # pipeline_faults: the reward that fails once, on cue

    import torch
    from prefect.testing.utilities import prefect_test_harness

    from benchmarks.cases import MODELS
    from comlrl_core.storage import open_storage
    from comlrl_core.tiny_models import build_tiny_models
    from flows.pipeline import train_pipeline

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="comlrl-bench-pipeline-"))
    names = MODELS[args.size]
    built = build_tiny_models(work / "models", names=[names["qwen2"], names["llama"]])
    models = {"qwen2-tiny": built[names["qwen2"]], "llama-tiny": built[names["llama"]]}
    steps = args.prompts * args.epochs
    figures = {}
    with prefect_test_harness(server_startup_timeout=120):
        train_pipeline(_spec(models, str(work / "warmup"), 2, 1, "comlrl_core.environments:length_ratio_reward"))

        # Direct and flow runs in alternating order, each pair on fresh storage: the machine's speed
        # drifts by more than the overhead, so the figure is the median over pairs.
        directs, flows = [], []
        for repeat in range(args.repeats):
            for mode in (("direct", "flow") if repeat % 2 == 0 else ("flow", "direct")):
                spec = _spec(models, str(work / f"{mode}-{repeat}"), args.prompts, args.epochs,
                             "comlrl_core.environments:length_ratio_reward")
                start = time.perf_counter()
                if mode == "flow":
                    train_pipeline(spec)
                    flows.append(time.perf_counter() - start)
                    continue
                trainer = spec.build_trainer()
                trainer.train()
                directs.append(time.perf_counter() - start)
                if repeat == 0:  # what one checkpoint costs the flow: written, then stored and verified
                    start = time.perf_counter()
                    open_storage(str(work / "store")).put_dir(trainer.save_checkpoint(work / "ck" / "checkpoint-1"), "ck")
                    figures["checkpoint_cost_s"] = time.perf_counter() - start
                del trainer
        figures.update(direct_s=statistics.median(directs), flow_s=statistics.median(flows),
                       pair_overheads_pct=[round(100 * (f - d) / d, 1) for d, f in zip(directs, flows)])

        # Fail at the last step's reward call: everything up to the last checkpoint is uploaded.
        os.environ.update(COMLRL_FAULT_MARKER=str(work / "fault-happened"), COMLRL_FAULT_AT=str(steps))
        spec = _spec(models, str(work / "resume"), args.prompts, args.epochs, "pipeline_faults:fail_once", args.checkpoint_steps)
        start = time.perf_counter()
        assert train_pipeline(spec, return_state=True).is_failed()
        figures["failed_run_s"] = time.perf_counter() - start
        start = time.perf_counter()
        train_pipeline(spec)
        figures["resumed_run_s"] = time.perf_counter() - start

    per_step = figures["direct_s"] / steps
    redone = steps - (steps - 1) // args.checkpoint_steps * args.checkpoint_steps  # since the last checkpoint
    figures.update(size=args.size, steps=steps, s_per_step=per_step,
                   overhead_s=figures["flow_s"] - figures["direct_s"],
                   overhead_pct=100 * (figures["flow_s"] - figures["direct_s"]) / figures["direct_s"],
                   checkpoint_steps=args.checkpoint_steps, redone_steps=redone,
                   redone_work_s=redone * per_step, resume_fixed_s=figures["resumed_run_s"] - redone * per_step)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))
    print(f"overhead per pair (%): {figures['pair_overheads_pct']}")
    print(f"\n| size | steps | direct | flow | overhead | one checkpoint | resumed re-run | "
          f"of which redone work | fixed resume cost |\n|---|---|---|---|---|---|---|---|---|\n"
          f"| {args.size} | {steps} | {figures['direct_s']:.1f} s | {figures['flow_s']:.1f} s | "
          f"{figures['overhead_s']:.1f} s ({figures['overhead_pct']:.1f}%) | {figures['checkpoint_cost_s']:.2f} s | "
          f"{figures['resumed_run_s']:.1f} s | {figures['redone_work_s']:.1f} s ({redone} steps) | "
          f"{figures['resume_fixed_s']:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
