"""Data parallelism for real: two gloo processes started by ``accelerate launch`` on this CPU.

Every job is a fresh process (``tests/distributed_job.py``), one process plain ``python``, two under
the launcher the pipeline uses. Two processes with per-process batches of B must train as one
process with 2B (the same global batch); checkpoints carry over between process counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from comlrl_core.checkpoint import read_checkpoint_metadata
from tasks.launch import accelerate_command, run_streaming

JOB = str(Path(__file__).with_name("distributed_job.py"))
ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def launch(tmp: Path, job: dict, processes: int) -> dict:
    """Run the job; returns each rank's report, rank 0's final weights and history."""
    tmp.mkdir(parents=True)
    job = {**job, "out": str(tmp)}
    (tmp / "job.json").write_text(json.dumps(job))
    target = [JOB, str(tmp / "job.json")]
    command = accelerate_command(processes, target) if processes > 1 else [sys.executable, *target]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ, **ENV})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    ranks = [json.loads((tmp / f"rank-{r}.json").read_text()) for r in range(processes)]
    return {"ranks": ranks, "weights": load_file(tmp / "final.safetensors"),
            "history": json.loads((tmp / "history.json").read_text())}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_same_training(a: dict, b: dict, start_dir: str) -> None:
    """``a`` and ``b`` trained alike: apart by under 1% of how far training moved agent 0.

    Float sums in another order (a gradient summed over ranks, batches padded to other lengths, a
    rank's smaller mini-batch running its prompts within the full rows instead of once) differ in
    the last bits, and Adam's normalised step can turn such a difference in a near-zero gradient
    into a visible fraction of the learning rate; a logic error moves weights by far more.
    """
    start = load_file(Path(start_dir) / "model.safetensors")
    moved = max_difference(start, {k: a[f"agents.0.{k}"] for k in start})
    assert moved > 1e-3  # training did move the weights
    assert max_difference(a, b) < 1e-2 * moved


@pytest.fixture(scope="module")
def magrpo_runs(tiny_models, tmp_path_factory):
    """MAGRPO for 2 epochs of 4 items: one process with batches of 2, two processes with batches of 1."""
    root = tmp_path_factory.mktemp("dp")
    base = {"algorithm": "magrpo", "models": tiny_models}
    one = launch(root / "one", {**base, "config": {"rollout_buffer_size": 2, "num_train_epochs": 2},
                                "checkpoint_dir": str(root / "one-ckpt")}, 1)
    two = launch(root / "two", {**base, "config": {"rollout_buffer_size": 1, "num_train_epochs": 2},
                                "checkpoint_dir": str(root / "two-ckpt"), "export": str(root / "two-export"),
                                "wandb": {"mode": "offline", "project": "dp", "dir": str(root / "wandb")}}, 2)
    return {"root": root, "base": base, "one": one, "two": two}


def test_two_processes_train_like_one_with_the_same_global_batch(magrpo_runs, tiny_models):
    one, two = magrpo_runs["one"], magrpo_runs["two"]
    assert_same_training(one["weights"], two["weights"], tiny_models["qwen2-tiny"])
    assert one["history"][-1]["step"] == two["history"][-1]["step"]  # env steps count both ranks' items
    assert two["ranks"][0]["digest"] == two["ranks"][1]["digest"]  # the ranks hold identical models


def test_only_rank_zero_writes_checkpoints_exports_and_wandb(magrpo_runs):
    root, two = magrpo_runs["root"], magrpo_runs["two"]
    rank0, rank1 = two["ranks"]
    assert rank0["writes"] == ["checkpoint checkpoint-1", "checkpoint checkpoint-2", "export"]
    assert rank1["writes"] == []
    assert sorted(p.name for p in (root / "two-ckpt").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert (root / "two-export" / "agent_0" / "model.safetensors").is_file()
    assert len(list((root / "wandb" / "wandb").glob("offline-run-*"))) == 1
    meta = read_checkpoint_metadata(root / "two-ckpt" / "checkpoint-2")
    assert meta["wandb"]["id"]


def test_resume_under_two_processes_is_exact(magrpo_runs):
    root, base, two = magrpo_runs["root"], magrpo_runs["base"], magrpo_runs["two"]
    resumed = launch(root / "two-resumed", {**base, "config": {"rollout_buffer_size": 1, "num_train_epochs": 2},
                                            "resume": str(root / "two-ckpt" / "checkpoint-1")}, 2)
    assert resumed["ranks"][0]["digest"] == two["ranks"][0]["digest"]
    assert [h["step"] for h in resumed["history"]] == [h["step"] for h in two["history"]]


@pytest.mark.parametrize("written, resumed_on", [(2, 1), (1, 2)])
def test_resume_with_another_process_count(magrpo_runs, tiny_models, written, resumed_on):
    """Scaling the per-process batch with the process count keeps the global batch, and the run."""
    root, base = magrpo_runs["root"], magrpo_runs["base"]
    source = {2: ("two", "two-ckpt"), 1: ("one", "one-ckpt")}[written]
    resumed = launch(root / f"from-{written}-on-{resumed_on}",
                     {**base, "config": {"rollout_buffer_size": 2 // resumed_on, "num_train_epochs": 2},
                      "resume": str(root / source[1] / "checkpoint-1")}, resumed_on)
    assert_same_training(resumed["weights"], magrpo_runs[source[0]]["weights"], tiny_models["qwen2-tiny"])
    assert resumed["history"][-1]["step"] == magrpo_runs[source[0]]["history"][-1]["step"]


def test_actor_critic_two_processes_train_like_one(tiny_models, tmp_path):
    """IAC with separate critics: advantages normalised over both ranks, actors and critics averaged."""
    base = {"algorithm": "iac", "models": tiny_models}
    one = launch(tmp_path / "one", {**base, "config": {"rollout_buffer_size": 4, "num_train_epochs": 2}}, 1)
    two = launch(tmp_path / "two", {**base, "config": {"rollout_buffer_size": 2, "num_train_epochs": 2}}, 2)
    assert any(k.startswith("critics.1.") for k in two["weights"])
    assert_same_training(one["weights"], two["weights"], tiny_models["qwen2-tiny"])
    losses = [h for h in two["history"] if "critic_0/value_loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(h["critic_0/value_loss"])) for h in losses)


def test_buffered_samples_of_a_mid_epoch_checkpoint_are_dealt_to_the_new_processes(tiny_models, tmp_path):
    """Checkpointed after the first global step with a sample in each process's buffer, a resume on one
    process holds both and updates at the same point as the two processes did."""
    base = {"algorithm": "magrpo", "models": tiny_models}
    two = launch(tmp_path / "two", {**base, "config": {"rollout_buffer_size": 2, "num_train_epochs": 1},
                                    "checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_steps": 2}, 2)
    assert two["ranks"][0]["writes"] == ["checkpoint checkpoint-1", "checkpoint checkpoint-2"]
    one = launch(tmp_path / "one", {**base, "config": {"rollout_buffer_size": 4, "num_train_epochs": 1},
                                    "resume": str(tmp_path / "ckpt" / "checkpoint-1")}, 1)
    assert_same_training(one["weights"], two["weights"], tiny_models["qwen2-tiny"])


def test_marlhf_two_processes_collect_fit_and_train_like_one(tiny_models, tmp_path):
    """Preference collection sharded and gathered in item order, each reward-model mini-batch split over
    the processes, then data-parallel policy training: as one process with the doubled batch."""
    base = {"algorithm": "marlhf", "models": tiny_models}
    one = launch(tmp_path / "one", {**base, "config": {"rollout_buffer_size": 2, "num_train_epochs": 1}}, 1)
    two = launch(tmp_path / "two", {**base, "config": {"rollout_buffer_size": 1, "num_train_epochs": 1}}, 2)
    assert any(k.startswith("reward_model.") for k in two["weights"])
    # A Bradley-Terry margin cancels the head's bias, so its gradient is float noise that Adam turns into
    # steps of the learning rate; it cannot change a margin or a MAGRPO advantage, so it is not compared.
    shift = "reward_model.0.reward_head.bias"
    assert_same_training({k: v for k, v in one["weights"].items() if k != shift},
                         {k: v for k, v in two["weights"].items() if k != shift}, tiny_models["qwen2-tiny"])
    pairs = [[h["preferences/num_pairs"] for h in run["history"] if "preferences/num_pairs" in h] for run in (one, two)]
    assert pairs[0] == pairs[1] and pairs[0][0] > 0  # every process's pairs were gathered


FINISH_FIRST = """
import atexit, os, sys, time
import torch
import torch.distributed as dist

# Registered before the context's own handler, so it runs after it: the group must be closed by then.
atexit.register(lambda: open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").write(str(dist.is_initialized())))
from comlrl_core import distributed

ctx = distributed.context()
for _ in range(20):
    dist.all_reduce(torch.ones(1000))
end = time.monotonic() + (1.0 if ctx.is_main else 0.0)
while time.monotonic() < end:
    pass
"""


def test_ranks_that_finish_first_exit_cleanly(tmp_path):
    """Rank 0 outlives the others (it uploads and exports after training). A rank that exited with its
    gloo group open could die by SIGABRT ("terminate called without an active exception"; from one job
    in six to one in two here, more under load), and the launcher then killed rank 0 mid-upload. Every
    process must close its group on the way out: a handler registered before the context's runs after
    it and finds the group closed."""
    script = tmp_path / "finish_first.py"
    script.write_text(FINISH_FIRST)
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                               os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(accelerate_command(4, [str(script), str(tmp_path)]), capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {r: (tmp_path / str(r)).read_text() for r in range(4)} == {r: "False" for r in range(4)}


def test_a_failed_job_names_the_first_error_any_process_printed():
    """The rank that failed first prints its exception first; the others then fail on the closed
    connection and their tracebacks fill the last lines. The error names the first one."""
    script = ("print('[rank0]: Traceback (most recent call last):'); "
              "print('[rank0]: RuntimeError: injected failure'); "
              "[print('[rank1]:   File \"x.py\", line', i) for i in range(30)]; "
              "print('[rank1]: RuntimeError: Connection closed by peer'); raise SystemExit(1)")
    lines = []
    with pytest.raises(RuntimeError) as failed:
        run_streaming([sys.executable, "-c", script], lines.append)
    assert "exited with status 1 (first error: RuntimeError: injected failure)" in str(failed.value)
    assert str(failed.value).endswith("[rank1]: RuntimeError: Connection closed by peer") and len(lines) == 33
    run_streaming([sys.executable, "-c", "print('ValueErrors: none')"], lines.append)  # exit 0: nothing raised
