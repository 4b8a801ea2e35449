"""The Prefect pipeline on a real (temporary) Prefect API: every algorithm, resume three ways, caching, S3."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from prefect.client.orchestration import get_client
from prefect.testing.utilities import prefect_test_harness
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from comlrl_core.environments import length_ratio_dataset
from comlrl_core.checkpoint import verify_dir
from comlrl_core.storage import open_storage
from comlrl_core.utils import read_checkpoint_metadata
from comlrl_core.tiny_models import build_tiny_models
from flows.cli import demo_spec
from flows.cli import main as cli_main
from flows.pipeline import train_pipeline
from tasks.spec import RunSpec
from tasks.stages import plan_stages

from helpers import exported_weights, s3_server, same_weights, spec_for

TESTS = Path(__file__).parent


@pytest.fixture(scope="module", autouse=True)
def prefect_api():
    with prefect_test_harness(server_startup_timeout=90):
        yield


async def _task_states(flow_run_id) -> dict[str, str]:
    async with get_client() as client:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name: run.state.name for run in runs}


def task_states(state) -> dict[str, str]:
    import asyncio

    return asyncio.run(_task_states(state.state_details.flow_run_id))


# ---- the spec ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, field", [
    ({"algorithm": "ppo"}, "algorithm"),
    ({"reward_func": "comlrl_core.environments:nope"}, "reward_func"),
    ({"reward_func": "no_such_module:f"}, "reward_func"),
    ({"train_dataset": {"file": "/does/not/exist.jsonl"}}, "train_dataset"),
    ({"config": {"agent_learning_rate": -1.0}}, "agent_learning_rate"),
    ({"config": {"learning_rate": 1e-3}}, "learning_rate"),
    ({"name": "../escape"}, "name"),
    ({"name": "other-run/LATEST"}, "name"),
    ({"init_from": "../other-run/export-0123"}, "init_from"),
    ({"name": "other-run/0123456789abcdef/x"}, "name"),
    ({"storage_uri": "x"}, "storage_uri"),
])
def test_bad_specs_are_refused_naming_the_field(tiny_models, tmp_path, change, field):
    base = demo_spec("magrpo", {k: Path(v) for k, v in tiny_models.items()}, str(tmp_path))
    config = {**base["config"], **change.pop("config", {})}
    with pytest.raises((ValueError, ValidationError), match=field):
        RunSpec(**{**base, "config": config, **change})


def test_stage_plans():
    models = {"qwen2-tiny": Path("q"), "llama-tiny": Path("l")}
    kinds = {a: [s["kind"] for s in plan_stages(RunSpec.model_construct(**{**demo_spec(a, models, "/tmp"),
                                                                            "stage_epochs": 4}))]
             for a in ("magrpo", "marlhf", "marlhf_iter")}
    assert kinds["magrpo"] == ["policy", "policy"]
    assert kinds["marlhf"] == ["collect", "fit", "policy", "policy"]
    assert kinds["marlhf_iter"] == ["collect", "fit", "policy"] * 2
    for algorithm in ("magrpo", "marlhf", "marlhf_iter"):
        spec = RunSpec(**demo_spec(algorithm, models, "/tmp"))
        assert spec.planned_stages() == len(plan_stages(spec))


# ---- every algorithm -----------------------------------------------------------------------------------

@pytest.fixture()
def trainer_builds(monkeypatch) -> list[str]:
    """The name of the task behind every ``RunSpec.build_trainer`` call (each still builds the trainer)."""
    from prefect.runtime import task_run

    builds, build = [], RunSpec.build_trainer

    def recorded(self, *args, **kwargs):
        builds.append(task_run.task_name)
        return build(self, *args, **kwargs)

    monkeypatch.setattr(RunSpec, "build_trainer", recorded)
    return builds


@pytest.mark.parametrize("algorithm", ["magrpo", "iac", "maac", "marlhf", "marlhf_iter"])
def test_every_algorithm_runs_and_exports(tiny_models, tmp_path, algorithm, trainer_builds):
    config = {"num_iterations": 1, "num_train_epochs": 1} if algorithm == "marlhf_iter" else {}
    if algorithm.startswith("marlhf"):
        config["reward_eval_fraction"] = 0.5
    spec = spec_for(tiny_models, tmp_path, algorithm, config=config,
                    eval_dataset={"builtin": "length_ratio", "size": 2, "offset": 6})
    result = train_pipeline(spec)
    assert trainer_builds == ["training-stage"] * len(plan_stages(spec))  # the last stage's trainer exported
    export = Path(result["uri"])
    assert (export / "manifest.json").is_file()
    AutoModelForCausalLM.from_pretrained(export / "agent_1")
    if algorithm.startswith("marlhf"):
        assert (export / "reward_model" / "reward_head.pt").is_file()
        assert 0.0 <= result["metrics"]["reward_model_heldout_accuracy"] <= 1.0
    assert result["metrics"]
    assert Path(result["curve"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Without the export and the last stage's final checkpoint, that stage resumes at its boundary (it
    # trains nothing, so it exports nothing) and the export task builds the export from the checkpoint.
    storage = open_storage(spec.storage)
    published = {key: storage.read_manifest(key) for key in (result["key"], f"{result['key']}-report")}
    last = max(d for d in storage.list_dirs(spec.run_key) if d.startswith("stage-"))
    final = next(d for d in storage.list_dirs(f"{spec.run_key}/{last}") if d.startswith("final-"))
    for key in [*published, f"{spec.run_key}/{last}/{final}"]:
        storage.delete(key)
    trainer_builds.clear()
    rebuilt = train_pipeline(spec)
    assert trainer_builds == ["training-stage", "export"]
    assert {key: storage.read_manifest(key) for key in published} == published  # every file identical
    assert rebuilt == result  # the same export key, digest, metrics and curve


def test_the_reported_after_is_the_exported_models_and_the_summary_shows_samples(tiny_models, tmp_path, capsys):
    from comlrl_core.environments import length_ratio_reward
    from comlrl_core.trainers.reinforce import MAGRPOTrainer
    from flows.cli import _report

    # Evaluations before training and at the end only; two stages, so the last one resumes a checkpoint.
    spec = spec_for(tiny_models, tmp_path, config={"eval_interval": 100, "eval_num_samples": 3},
                    eval_dataset={"builtin": "length_ratio", "size": 3, "offset": 6})
    result = train_pipeline(spec)
    history = json.loads((Path(result["uri"] + "-report") / "history.json").read_text())
    evals = [h["eval/turn_1/reward_mean"] for h in history if "eval/turn_1/reward_mean" in h]
    steps = [h["step"] for h in history if "eval/turn_1/reward_mean" in h]
    assert len(steps) == 3 and len(set(steps)) == 3  # before, at the stage boundary once, at the end
    export = Path(result["uri"])
    again = MAGRPOTrainer(agents=[str(export / "agent_0"), str(export / "agent_1")], reward_func=length_ratio_reward,
                          train_dataset=spec.train_dataset.load(), eval_dataset=spec.eval_dataset.load(),
                          args=spec.trainer_config())
    assert result["metrics"]["after"] == evals[-1] == again.evaluate()["eval/turn_1/reward_mean"]
    assert result["metrics"]["before"] == evals[0]

    before, after = result["samples"]
    assert (before["step"], after["step"]) == (0, history[-1]["step"])
    assert [len(r["samples"]) for r in result["samples"]] == [3, 3]
    assert after["samples"][0]["completions"] == [again.eval_samples[-1]["samples"][0]["completions"][i]
                                                  for i in range(2)]
    _report(result)
    out = capsys.readouterr().out
    assert "before (step 0, reward" in out and f"after (step {after['step']}, reward" in out


def test_a_template_the_data_cannot_fill_fails_before_any_stage(tiny_models, tmp_path):
    spec = RunSpec(task="writing", agent_model=tiny_models["qwen2-tiny"], config={"num_agents": 2},
                   prompt_templates={"user": "About {subject}", "chat": False}, storage=str(tmp_path / "runs"))
    with pytest.raises(ValueError, match=r"reads \['subject'\]"):
        train_pipeline(spec)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("stage-*"))


# ---- resume -----------------------------------------------------------------------------------------

def resumable_spec(tiny_models, tmp_path, storage):
    return spec_for(tiny_models, tmp_path, reward_func="pipeline_faults:fail_once", checkpoint_steps=1,
                    storage=str(storage), train_dataset={"builtin": "length_ratio", "size": 3})


@pytest.fixture()
def uninterrupted(tiny_models, tmp_path):
    """Exported weights of the same spec run without a fault (into other storage)."""
    return exported_weights(train_pipeline(resumable_spec(tiny_models, tmp_path, tmp_path / "clean")))


@pytest.fixture()
def faulty(uninterrupted, monkeypatch, tmp_path):
    """From here on, reward call 5 (inside the second training stage) fails once."""
    marker = tmp_path / "fault-happened"
    monkeypatch.setenv("COMLRL_FAULT_MARKER", str(marker))
    monkeypatch.setenv("COMLRL_FAULT_AT", "5")
    return marker


def test_a_new_flow_run_skips_completed_stages_and_resumes_the_failed_one(tiny_models, tmp_path, faulty,
                                                                          uninterrupted):
    spec = resumable_spec(tiny_models, tmp_path, tmp_path / "runs")
    failed = train_pipeline(spec, return_state=True)
    assert failed.is_failed() and faulty.exists()
    storage = open_storage(spec.storage)
    stage_dir = next(d for d in storage.list_dirs(spec.run_key) if d.startswith("stage-01-policy"))
    assert storage.list_dirs(f"{spec.run_key}/{stage_dir}/partial")  # it had checkpointed before it failed
    second = train_pipeline(spec, return_state=True)
    assert second.is_completed()
    states = task_states(second)
    assert states["stage-00-policy"] == "Cached"
    assert states["stage-01-policy"] == "Completed"
    assert same_weights(exported_weights(second.result()), uninterrupted)


def test_a_flow_retry_resumes(tiny_models, tmp_path, faulty, uninterrupted):
    spec = resumable_spec(tiny_models, tmp_path, tmp_path / "runs")
    state = train_pipeline.with_options(retries=1, retry_delay_seconds=0)(spec, return_state=True)
    assert state.is_completed() and faulty.exists()
    assert same_weights(exported_weights(state.result()), uninterrupted)
    writers = checkpoint_writers(open_storage(spec.storage), spec.run_key)
    flow_run = str(state.state_details.flow_run_id)
    stage1 = {key.split("/")[1] for key in writers if key.startswith("stage-01")}
    assert stage1 == {f"{flow_run}-1", f"{flow_run}-2"}  # the retry never writes into the first attempt's files
    assert len(exports_of(open_storage(spec.storage), spec.run_key)) == 1


def checkpoint_writers(storage, run_key: str) -> dict[str, set[str]]:
    """``{stage/owner: trainer run ids}`` of every partial checkpoint directory, each verified on the way."""
    writers = {}
    for stage in storage.list_dirs(run_key):
        for owner in storage.list_dirs(f"{run_key}/{stage}/partial"):
            for name in storage.list_dirs(f"{run_key}/{stage}/partial/{owner}"):
                local = Path(storage.uri(f"{run_key}/{stage}/partial/{owner}/{name}"))
                verify_dir(local)
                writers.setdefault(f"{stage}/{owner}", set()).add(read_checkpoint_metadata(local)["run_id"])
    return writers


def exports_of(storage, run_key: str) -> list[str]:
    return [d for d in storage.list_dirs(run_key) if d.startswith("export-") and not d.endswith("-report")]


def test_a_killed_process_resumes_on_rerun(tiny_models, tmp_path, faulty, uninterrupted):
    from prefect.settings import get_current_settings

    spec = resumable_spec(tiny_models, tmp_path, tmp_path / "runs")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    env = {**os.environ, "COMLRL_FAULT_KILL": "1", "PREFECT_API_URL": str(get_current_settings().api.url),
           "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "flows.cli", "run", str(spec_file)]

    def run(log: str) -> tuple[int, str]:
        with open(tmp_path / log, "w") as out:
            code = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode
        return code, (tmp_path / log).read_text()

    code, _ = run("killed.log")
    assert code == -9 and faulty.exists()  # SIGKILL in the middle of the second stage
    code, output = run("rerun.log")
    assert code == 0, output[-3000:]
    export = next(line.split(": ", 1)[1] for line in output.splitlines() if line.startswith("export: "))
    assert same_weights(exported_weights({"uri": export}), uninterrupted)


async def _logs(flow_run_id) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async with get_client() as client:
        logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs]


def test_a_two_process_stage_streams_its_logs_and_resumes_on_retry(tiny_models, tmp_path, monkeypatch):
    """``num_processes=2``: each stage is an ``accelerate launch`` job; a rank failing fails the task, and the
    retried flow resumes the stage from its checkpoint to the weights of an uninterrupted run."""
    import asyncio

    monkeypatch.setenv("PYTHONPATH", f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")  # pipeline_faults
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def spec(storage):
        return spec_for(tiny_models, tmp_path, reward_func="pipeline_faults:fail_once", checkpoint_steps=1,
                        storage=str(storage), train_dataset={"builtin": "length_ratio", "size": 3}, num_processes=2)

    uninterrupted = exported_weights(train_pipeline(spec(tmp_path / "clean")))
    marker = tmp_path / "fault-happened"
    monkeypatch.setenv("COMLRL_FAULT_MARKER", str(marker))
    monkeypatch.setenv("COMLRL_FAULT_AT", "2")  # rank 0's second reward call: stage 0, after its first checkpoint
    state = train_pipeline.with_options(retries=1, retry_delay_seconds=0)(spec(tmp_path / "runs"), return_state=True)
    assert state.is_completed() and marker.exists()
    assert same_weights(exported_weights(state.result()), uninterrupted)
    messages = asyncio.run(_logs(state.state_details.flow_run_id))
    assert any("injected failure in the reward function" in m for m in messages)  # a rank's traceback, streamed
    failed = [m for m in messages if m.startswith("Finished in state Failed")]  # the task's error names it too
    assert failed and "injected failure in the reward function" in failed[0]
    assert any(m.startswith("Resuming stage") and "stage-00-policy" in m for m in messages)
    assert any(m.startswith("Checkpoint checkpoint-") for m in messages)  # printed by rank 0 of the job


def test_two_runs_of_one_spec_at_once_do_not_collide(tiny_models, tmp_path):
    from prefect.settings import get_current_settings

    spec = spec_for(tiny_models, tmp_path, checkpoint_steps=1)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    env = {**os.environ, "PREFECT_API_URL": str(get_current_settings().api.url)}
    logs = [open(tmp_path / f"run-{i}.log", "w") for i in range(2)]
    runs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(spec_file)], env=env, stdout=log,
                             stderr=subprocess.STDOUT) for log in logs]
    assert [run.wait(600) for run in runs] == [0, 0]
    exports = [next(line.split(": ", 1)[1] for line in (tmp_path / f"run-{i}.log").read_text().splitlines()
                    if line.startswith("export: ")) for i in range(2)]
    storage = open_storage(spec.storage)
    for i, export in enumerate(exports):  # each export is complete and intact
        storage.get_dir(str(Path(export).relative_to(storage.uri())), tmp_path / f"export-{i}")
    assert same_weights(exported_weights({"uri": exports[0]}), exported_weights({"uri": exports[1]}))
    writers = checkpoint_writers(storage, spec.run_key)  # no interleaved writes: one trainer run per directory
    assert writers and all(len(run_ids) == 1 for run_ids in writers.values())
    assert sorted(exports_of(storage, spec.run_key)) == sorted({Path(e).name for e in exports})  # one per run
    assert json.loads(storage.get_text(f"{spec.name}/LATEST"))["uri"] in exports


def test_retraining_starts_from_the_latest_export_and_keeps_every_export(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("COMLRL_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in length_ratio_dataset(3)))
    spec = spec_for(tiny_models, tmp_path, init_from="latest", train_dataset={"file": str(data)})
    storage = open_storage(spec.storage)
    first = train_pipeline(spec)  # no export yet: starts from agent_model
    assert json.loads(storage.get_text(f"{spec.name}/LATEST"))["key"] == first["key"]
    data.write_text("".join(json.dumps(d) + "\n" for d in length_ratio_dataset(3, offset=3)))  # new data
    second = train_pipeline(spec, return_state=True)
    assert task_states(second)["stage-00-policy"] == "Completed"  # new data and new start: no stale cache hit
    second = second.result()
    assert second["key"] != first["key"] and storage.exists(first["key"])  # the previous export is untouched
    assert json.loads(storage.get_text(f"{spec.name}/LATEST"))["key"] == second["key"]
    resumed_from = load_file(tmp_path / "cache" / "exports" / first["digest"] / "agent_0" /
                             "model.safetensors")
    first_weights = exported_weights(first)["agent_0/model.safetensors"]
    assert all(torch.equal(resumed_from[k], first_weights[k]) for k in first_weights)


def test_changed_model_weights_recompute_every_stage(tiny_models, tmp_path):
    models = tmp_path / "models"
    build_tiny_models(models, names=["qwen2-tiny", "llama-tiny"])
    spec = spec_for({k: str(models / k) for k in ("qwen2-tiny", "llama-tiny")}, tmp_path)
    first = train_pipeline(spec, return_state=True)
    cached = train_pipeline(spec, return_state=True)
    assert set(task_states(cached).values()) == {"Cached", "Completed"}
    assert task_states(cached)["stage-00-policy"] == "Cached"
    build_tiny_models(models, seed=1, names=["qwen2-tiny"])  # same path, new weights
    changed = train_pipeline(spec, return_state=True)
    assert task_states(changed)["stage-00-policy"] == "Completed"
    assert not same_weights(exported_weights(first.result()), exported_weights(changed.result()))


# ---- S3 and the CLI ------------------------------------------------------------------------------------

def test_export_to_s3_round_trip(tiny_models, tmp_path, monkeypatch):
    with s3_server(monkeypatch, "comlrl-test"):
        spec = spec_for(tiny_models, tmp_path, storage="s3://comlrl-test/runs")
        result = train_pipeline(spec)
        assert result["uri"].startswith("s3://comlrl-test/runs/")
        storage = open_storage(spec.storage)
        storage.get_dir(result["key"], tmp_path / "downloaded")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "downloaded" / "agent_0")
        assert model.config.model_type == "qwen2"


def test_cli_reports_a_bad_spec_before_loading_anything(tmp_path, capsys):
    spec_file = tmp_path / "bad.yaml"
    spec_file.write_text(yaml.safe_dump({"algorithm": "magrpo", "agent_model": "x", "config": {"num_generations": 1}}))
    assert cli_main(["run", str(spec_file)]) == 2
    assert "num_generations" in capsys.readouterr().err


def test_a_storage_path_that_cannot_hold_directories_is_refused_before_any_model_loads(tiny_models, tmp_path,
                                                                                       capsys, trainer_builds):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    spec = spec_for(tiny_models, tmp_path, storage=str(blocker / "runs"))
    message = f"storage={str(blocker / 'runs')!r}: {blocker} is a file, not a directory"
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    assert cli_main(["run", str(spec_file)]) == 2  # the CLI refuses it before a flow run exists
    assert message in capsys.readouterr().err
    state = train_pipeline(spec, return_state=True)  # a deployment's flow run: its first task refuses it
    assert state.is_failed() and message in str(state.result(raise_on_failure=False))
    assert trainer_builds == []


BILLION_LAUGHS = "\n".join(["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"] + [
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]" for i in range(8)] + ["name: *i", ""])


@pytest.mark.parametrize("text, message", [
    (BILLION_LAUGHS, "more than 100000 values once its YAML aliases are expanded"),
    ("a: " + "[" * 20000 + "]" * 20000 + "\n", "nested too deeply"),
    ("name: x\n" + "# padding\n" * 120000, "a run spec is at most 1048576 bytes"),
    ("{algorithm: magrpo, agent_model: x, config: {num_train_epochs: 1000000000000}}",
     "plan 1000000000000 pipeline stages; at most 10000"),
])
def test_resource_bombs_in_a_spec_file_are_refused_at_once(tmp_path, text, message):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(text)
    # A child process with a deadline: without the limits these exhaust memory or run for minutes.
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(spec_file)], capture_output=True,
                          text=True, timeout=60, cwd=TESTS.parent)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("name, text, message", [
    ("empty.jsonl", "", "train_dataset.file: {path} holds no items."),
    ("broken.jsonl", '{"prompt": "a"}\n\n{"prompt": \n', "train_dataset.file: {path} line 3 is not valid JSON"),
    ("list.jsonl", '{"prompt": "a"}\n[1, 2]\n', "train_dataset.file: {path} line 2 is a JSON list, not an object"),
    ("broken.json", '[{"prompt": "a"},\n {"prompt": }]', "train_dataset.file: {path} line 2 is not valid JSON"),
    ("latin1.jsonl", b'{"prompt": "caf\xe9"}\n', "train_dataset.file: {path} is not UTF-8 text"),
    ("no-prompt.jsonl", '{"question": "a"}\n', "train_dataset: its first item has no non-empty 'prompt' field"),
    ("script", None, "train_dataset.path='{path}' holds a Python loading script (load.py), which is never run"),
])
def test_a_bad_dataset_is_refused_naming_the_field_file_and_line(tiny_models, tmp_path, name, text, message):
    path = tmp_path / name
    if text is None:
        path.mkdir()
        (path / "load.py").write_text("import os\n")
        source = {"path": str(path)}
    else:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        source = {"file": str(path)}
    spec = spec_for(tiny_models, tmp_path, train_dataset=source)
    with pytest.raises(ValueError) as refused:
        spec.build_trainer()  # the data is read, and its first item checked, before any weights load
    assert message.format(path=path) in str(refused.value)


def test_an_expected_error_in_a_task_is_reported_without_a_traceback(tiny_models, tmp_path, capfd):
    data = tmp_path / "no-prompt.jsonl"
    data.write_text('{"question": "a"}\n')
    spec = spec_for(tiny_models, tmp_path, train_dataset={"file": str(data)})
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    assert cli_main(["run", str(spec_file)]) == 2
    output = "".join(capfd.readouterr())
    assert "error: train_dataset: its first item has no non-empty 'prompt' field" in output
    assert "Traceback" not in output
    state = train_pipeline(spec, return_state=True)  # the flow run ends on the task's message
    assert state.is_failed() and "its first item has no non-empty 'prompt' field" in state.message


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            listed = task / "children"
            children = {int(c) for c in listed.read_text().split()} if listed.exists() else set()
            todo += children - found
            found |= children
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_cli_promptly_with_no_process_left_and_the_run_crashed(tiny_models, tmp_path, signum):
    import sqlite3
    import threading

    spec = spec_for(tiny_models, tmp_path, config={"num_train_epochs": 50}, checkpoint_steps=1)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    cli = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(spec_file)], env=env, cwd=TESTS.parent,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(cli.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 180
    while not any("Checkpoint checkpoint-2 " in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.2)
    children = _descendants(cli.pid)
    assert children, "".join(lines)[-3000:]  # the temporary Prefect server, at least
    cli.send_signal(signum)
    assert cli.wait(timeout=60) == 130  # promptly: a 50-epoch run was under way
    reader.join(timeout=10)
    output = "".join(lines)
    assert f"stopped ({signum.name}); run it again to resume" in output, output[-3000:]
    time.sleep(1)
    left = [pid for pid in children if Path(f"/proc/{pid}").exists()]
    assert not left, f"processes left behind: {left}"
    with sqlite3.connect(tmp_path / "prefect-home" / "prefect.db") as db:
        states = [row[0] for row in db.execute("SELECT state_type FROM flow_run")]
    assert states and states[-1] in ("CRASHED", "CANCELLED"), states
