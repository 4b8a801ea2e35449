"""The benchmark harness: ``python -m benchmarks.run [--reference] [--cases ...] [--sizes tiny small]``.

Each case runs in a fresh process per implementation, the two alternating, so neither inherits the
other's warm caches or memory. Results go to ``OUT/results.jsonl`` (one JSON line per run) and a
Markdown table on stdout with the speed-up (reference seconds per step / ours) and the memory ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.cases import CASES, MODELS, expand

ROOT = Path(__file__).resolve().parent.parent


def _env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run_case(python: str, script: list[str], case: dict, workdir: Path) -> dict:
    """One case in a fresh process; its ``RESULT`` line, or an error record with the output's tail."""
    workdir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([python, *script, json.dumps(case)], cwd=workdir, env=_env(case["settings"]["threads"]),
                          capture_output=True, text=True, timeout=3600)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
    return {"case": case["name"], "error": f"exit {done.returncode}: " + " | ".join(tail)}


def table(results: list[dict]) -> str:
    """Median figures per case and implementation, with ours-vs-reference ratios."""
    by = {}
    for r in results:
        by.setdefault(r["case"], {}).setdefault(r.get("impl", "?"), []).append(r)
    lines = ["| case | impl | s/step | gen tok/s | step tok/s | gen share | opt steps | peak RSS MB | eval before → after |",
             "|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for case, impls in by.items():
        for impl, runs in sorted(impls.items()):
            ok = [r for r in runs if "error" not in r]
            if not ok:
                lines.append(f"| {case} | {impl} | error: {runs[0]['error'][:80]} | | | | | | |")
                continue
            med = {k: statistics.median(r[k] for r in ok) for k in
                   ("s_per_step", "step_tok_s", "generate_share", "optimizer_steps", "peak_rss_mb")}
            gen = statistics.median(r["generate_tok_s"] or 0 for r in ok)
            lines.append(f"| {case} | {impl} | {med['s_per_step']:.3f} | {gen:.0f} | {med['step_tok_s']:.0f} | "
                         f"{med['generate_share']:.0%} | {med['optimizer_steps']:.0f} | {med['peak_rss_mb']:.0f} | "
                         f"{ok[0]['eval_before']} → {ok[0]['eval_after']} |")
        ours = [r for r in impls.get("ours", []) if "error" not in r]
        ref = [r for r in impls.get("reference", []) if "error" not in r]
        if ours and ref:
            speed = statistics.median(r["s_per_step"] for r in ref) / statistics.median(r["s_per_step"] for r in ours)
            memory = statistics.median(r["peak_rss_mb"] for r in ours) / statistics.median(r["peak_rss_mb"] for r in ref)
            ratios.append(f"| {case} | {speed:.2f}× | {memory:.2f} |")
    if ratios:
        lines += ["", "| case | speed-up (reference s/step ÷ ours) | peak memory (ours ÷ reference) |",
                  "|---|---|---|", *ratios]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=1, help="runs per case and implementation (median reported)")
    parser.add_argument("--reference", action="store_true",
                        help="also run comlrl==1.4.3 (installed once into OUT/.reference-venv)")
    parser.add_argument("--out", type=Path, default=ROOT / ".bench")
    args = parser.parse_args(argv)

    from comlrl_core.tiny_models import build_tiny_models

    models_dir = args.out / "models"
    names = sorted({name for size in args.sizes for name in MODELS[size].values()})
    missing = [n for n in names if not (models_dir / n / "config.json").is_file()]
    if missing:
        build_tiny_models(models_dir, names=missing)
    model_dirs = {n: str(models_dir / n) for n in names}
    implementations = [("ours", sys.executable, ["-m", "benchmarks.ours_case"])]
    if args.reference:
        from benchmarks.reference_env import reference_python

        implementations.append(("reference", str(reference_python(args.out)),
                                [str(ROOT / "benchmarks" / "reference_case.py")]))
    results = []
    with open(args.out / "results.jsonl", "a") as log:
        for size in args.sizes:
            for name in args.cases:
                case = expand(name, size, model_dirs)
                for repeat in range(args.repeats):
                    # Alternate which implementation goes first, so neither always runs on a cooler machine.
                    order = implementations if repeat % 2 == 0 else implementations[::-1]
                    for impl, python, script in order:
                        figures = {"impl": impl, **run_case(python, script, case, args.out / "work" / impl)}
                        results.append(figures)
                        log.write(json.dumps(figures) + "\n")
                        log.flush()
                        print(json.dumps(figures), flush=True)
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
