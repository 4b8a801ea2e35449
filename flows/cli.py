"""``comlrl-pipeline``: the command-line face of the pipeline (run a spec, run the demo, build tiny models)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEMO_CONFIGS = {
    "magrpo": {"num_generations": 6, "rollout_buffer_size": 1},
    "iac": {"num_generations": 4, "rollout_buffer_size": 4, "critic_learning_rate": 1e-3},
    "maac": {"num_generations": 4, "rollout_buffer_size": 4, "critic_learning_rate": 1e-3},
    "marlhf": {"num_generations": 6, "rollout_buffer_size": 1, "reward_model_device": None,
               "preference_num_candidates": 12, "preference_pairs_per_sample": 16, "reward_learning_rate": 1e-3,
               "reward_num_train_epochs": 3, "reward_train_batch_size": 4},
    "marlhf_iter": {"num_generations": 6, "rollout_buffer_size": 1, "reward_model_device": None,
                    "num_iterations": 2, "num_train_epochs": 2, "preference_num_candidates": 12,
                    "preference_pairs_per_sample": 16, "reward_learning_rate": 1e-3, "reward_num_train_epochs": 3,
                    "reward_train_batch_size": 4},
}


def demo_spec(algorithm: str, models: dict[str, Path], storage: str) -> dict:
    """A small cooperative run on the tiny models that finishes in minutes on a CPU."""
    config = {"num_agents": 2, "num_train_epochs": 8, "max_new_tokens": 16, "agent_learning_rate": 1e-2,
              "temperature": 1.0, "top_p": 1.0, "top_k": None, "eval_interval": 6, "eval_num_samples": 4,
              "verbose": False, **DEMO_CONFIGS[algorithm]}
    spec = {"name": f"demo-{algorithm.replace('_', '-')}", "algorithm": algorithm,
            "agent_model": str(models["qwen2-tiny"]), "config": config, "stage_epochs": 4,
            "train_dataset": {"builtin": "length_ratio", "size": 6},
            "eval_dataset": {"builtin": "length_ratio", "size": 4, "offset": 6}, "storage": storage}
    if algorithm in ("iac", "maac"):
        spec["critic_model"] = str(models["llama-tiny"])
    return spec


def _load_spec(data: dict):
    from pydantic import ValidationError

    from tasks.spec import RunSpec

    try:
        return RunSpec(**data)
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid run spec: {details}") from None


def _run_flow(spec) -> dict:
    from flows.pipeline import train_pipeline

    return train_pipeline(spec)


def _report(result: dict) -> None:
    metrics = result.get("metrics") or {}
    if metrics:
        print(f"{metrics['metric']}: {metrics['before']:.4f} -> {metrics['after']:.4f}")
    print(f"export: {result['uri']}")
    if result.get("curve"):
        print(f"curve: {result['curve']}")


def _run(args: argparse.Namespace) -> int:
    import yaml

    data = yaml.safe_load(Path(args.spec).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{args.spec} must hold a mapping of run-spec fields.")
    if args.storage:
        data["storage"] = args.storage
    _report(_run_flow(_load_spec(data)))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from comlrl_core.tiny_models import build_tiny_models

    workdir = args.workdir.resolve()
    models = build_tiny_models(workdir / "tiny-models", names=["qwen2-tiny", "llama-tiny"])
    spec = _load_spec(demo_spec(args.algorithm, models, args.storage or str(workdir / "runs")))
    print(f"demo: {args.algorithm} on tiny models in {workdir}")
    _report(_run_flow(spec))
    return 0


def _tiny_models(args: argparse.Namespace) -> int:
    from comlrl_core.tiny_models import build_tiny_models

    written = build_tiny_models(args.directory, seed=args.seed, names=args.names)
    for name, path in written.items():
        print(f"{name}\t{path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="comlrl-pipeline",
        description="Train cooperating LLM agents with multi-agent RL, as a Prefect pipeline.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="run the pipeline flow for a run spec (YAML)",
                              description="Validate SPEC.yaml (no model loads on a bad spec) and run the flow on "
                              "the current Prefect API (an ephemeral local one unless PREFECT_API_URL is set).")
    run.add_argument("spec", type=Path, help="run spec: algorithm, agents, config, datasets, storage, ...")
    run.add_argument("--storage", default=None, help="override the spec's storage (a directory or s3://bucket/prefix)")
    run.set_defaults(run=_run)
    demo = commands.add_parser("demo", help="build tiny models and run a small cooperative task end to end",
                               description="Builds tiny local models and runs the length-ratio task through the "
                               "flow, printing reward before -> after and where the export is.")
    demo.add_argument("--algorithm", default="magrpo", choices=sorted(DEMO_CONFIGS))
    demo.add_argument("--workdir", type=Path, default=Path("comlrl-demo"), help="tiny models and local runs go here")
    demo.add_argument("--storage", default=None, help="checkpoints and exports (default WORKDIR/runs; or s3://...)")
    demo.set_defaults(run=_demo)
    tiny = commands.add_parser(
        "tiny-models",
        help="write tiny random-weight models and tokenizers to a directory (offline, deterministic)",
        description="Write tiny causal LMs (Qwen2 and Llama, two sizes, two vocabularies) that load with "
        "AutoModelForCausalLM/AutoTokenizer.from_pretrained(DIRECTORY/NAME) and no network.",
    )
    tiny.add_argument("directory", type=Path, help="output directory; one sub-directory per model")
    tiny.add_argument("--seed", type=int, default=0, help="weights and tokenizers are a function of the seed")
    tiny.add_argument("--names", nargs="+", default=None, metavar="NAME", help="build only these models")
    tiny.set_defaults(run=_tiny_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
