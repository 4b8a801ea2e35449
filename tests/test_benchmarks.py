"""The benchmark harness runs a case end to end and reports every figure (no timing is asserted)."""

import json
import os
import subprocess
import sys

from benchmarks.run import ROOT, main, table


def test_the_harness_runs_a_case_and_reports_its_figures(tmp_path, capsys):
    assert main(["--cases", "magrpo-homogeneous", "--sizes", "tiny", "--out", str(tmp_path)]) == 0
    [record] = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert "error" not in record, record
    assert record["impl"] == "ours" and record["case"] == "magrpo-homogeneous/tiny" and record["items"] == 8
    assert record["optimizer_steps"] == 8  # 2 agents, one step per 2 buffered prompts, 8 prompts
    assert record["generated_tokens"] > 0 and 0 < record["generate_share"] < 1 and record["peak_rss_mb"] > 0
    assert isinstance(record["eval_before"], float) and isinstance(record["eval_after"], float)
    assert "| magrpo-homogeneous/tiny | ours |" in capsys.readouterr().out


def test_the_table_compares_both_implementations():
    figures = {"items": 8, "s_per_step": 0.1, "generate_tok_s": 100.0, "step_tok_s": 50.0, "generate_share": 0.5,
               "optimizer_steps": 8, "peak_rss_mb": 400.0, "eval_before": 0.0, "eval_after": 0.1}
    rows = [{"case": "c", "impl": "ours", **figures},
            {"case": "c", "impl": "reference", **figures, "s_per_step": 0.3, "peak_rss_mb": 500.0},
            {"case": "d", "impl": "reference", "error": "exit 1: boom"}]
    text = table(rows)
    assert "| c | 3.00× | 0.80 |" in text and "error: exit 1: boom" in text


def test_the_gpu_script_runs_on_a_cpu_when_allowed():
    """The prepared GPU script checked end to end on one layer, in its own process (its meter wraps
    the sampler for good); its figures are not asserted. Short prompts only: bfloat16 on a CPU without
    native support took over ten minutes for the 1024-token one."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--allow-cpu", "--layers", "1", "--steps", "1",
                           "--num-generations", "2", "--max-new-tokens", "4", "--prompt-lengths", "4", "16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    assert done.returncode == 0, done.stderr[-3000:]
    run, sampler, versus = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert run["generated_tokens"] > 0 and run["generate_tok_s"] > 0  # the sampler's calls were timed
    assert {"decode_bandwidth_fraction", "bf16_throughput_fraction"} <= run.keys()
    sampler = sampler["sampler"]
    assert sampler["lean_sampler_used"]
    assert min(sampler[f"{name}_tok_s"] for name in ("ours", "ours_op_by_op", "generate")) > 0
    assert sampler["decode_step_ms_fixed_shape_op_by_op"] > 0
    assert "decode_step_ms_cuda_graph" not in sampler  # CUDA only
    assert [c["prompt_tokens"] for c in versus["token_tree_vs_full_rows"]] == [4, 16]
    assert all(c["tree_over_full"] > 0 for c in versus["token_tree_vs_full_rows"])
