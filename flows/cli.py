"""``comlrl-pipeline``: the command-line face of the pipeline."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
