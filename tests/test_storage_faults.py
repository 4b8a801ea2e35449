"""Storage faults: an S3 endpoint that throttles, fails, drops connections or vanishes, and a full disk.

The S3 faults come from a real proxy (``s3_chaos.py``) in front of a real S3 server (moto); the full
disk is a real 2.5 MiB tmpfs. Required every time: bounded retries with backoff, a clear error
naming what failed once they are spent, and the previous valid checkpoint or export untouched.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.testing.utilities import prefect_test_harness

from comlrl_core.storage import StorageError, open_storage
from flows.pipeline import train_pipeline
from helpers import exported_weights, s3_server, same_weights, spec_for
from s3_chaos import ChaosProxy

TESTS = Path(__file__).parent
ATTEMPTS = 3  # AWS_MAX_ATTEMPTS for these tests


@pytest.fixture()
def chaos(monkeypatch):
    """The AWS environment pointed at a fault-injecting proxy in front of a real S3 server."""
    with s3_server(monkeypatch, "chaos") as upstream:
        proxy = ChaosProxy(upstream)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", str(ATTEMPTS))
        yield proxy
        proxy.down()


def make_dir(path: Path, files: dict) -> Path:
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def backoff(proxy: ChaosProxy, method: str, path: str) -> list[float]:
    times = [t for t, _ in proxy.attempts(method, path)]
    return [round(b - a, 3) for a, b in zip(times, times[1:])]


def test_throttling_5xx_and_dropped_connections_are_retried(chaos, tmp_path):
    storage = open_storage("s3://chaos/runs")
    source = make_dir(tmp_path / "src", {"model.safetensors": b"w" * 5000, "config.json": b"{}"})
    chaos.fail("503", times=2, method="PUT", path="model.safetensors")
    chaos.fail("500", times=1, method="PUT", path="config.json")
    chaos.fail("drop", times=2, method="GET", path="model.safetensors")
    storage.put_dir(source, "ck/checkpoint-1")
    storage.get_dir("ck/checkpoint-1", tmp_path / "back")  # every file checked against the manifest
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == b"w" * 5000
    assert [f["left"] for f in chaos.faults] == [0, 0, 0], "every injected fault was hit"
    print(f"\nS3 faults injected: 5 (2x503, 1x500, 2 dropped connections), all retried; "
          f"backoff between PUT attempts (s): {backoff(chaos, 'PUT', 'model.safetensors')}")


@pytest.mark.parametrize("fault, code", [("503", "SlowDown"), ("500", "InternalError"),
                                         ("drop", "ConnectionClosedError")])
def test_exhausted_retries_fail_clearly_and_the_previous_checkpoint_survives(chaos, tmp_path, fault, code):
    storage = open_storage("s3://chaos/runs")
    storage.put_dir(make_dir(tmp_path / "one", {"w.bin": b"1" * 100}), "ck/checkpoint-1")
    chaos.fail(fault, times=100, method="PUT", path="checkpoint-2")
    with pytest.raises(StorageError) as error:
        storage.put_dir(make_dir(tmp_path / "two", {"w.bin": b"2" * 100}), "ck/checkpoint-2")
    message = str(error.value)
    assert "s3://chaos/runs/ck/checkpoint-2/w.bin" in message and f"after {ATTEMPTS} attempts ({code})" in message
    assert len(chaos.attempts("PUT", "checkpoint-2")) == ATTEMPTS  # bounded: then it gave up
    assert not storage.exists("ck/checkpoint-2")
    storage.get_dir("ck/checkpoint-1", tmp_path / "back")
    assert (tmp_path / "back" / "w.bin").read_bytes() == b"1" * 100
    print(f"\n{fault}: {ATTEMPTS} attempts, backoff {backoff(chaos, 'PUT', 'checkpoint-2')} s, then: {message[:90]}...")


def test_endpoint_gone_mid_upload_leaves_the_previous_export_and_recovers(chaos, tmp_path):
    storage = open_storage("s3://chaos/runs")
    storage.put_dir(make_dir(tmp_path / "e1", {"a.bin": b"old", "b.bin": b"old"}), "export-1")
    storage.put_text("LATEST", "export-1")
    new = make_dir(tmp_path / "e2", {"a.bin": b"new", "b.bin": b"new"})
    chaos.fail("down-after", times=1, method="PUT", path="export-2/a.bin")  # one file lands, then the endpoint dies
    with pytest.raises(StorageError, match=r"export-2/[ab]\.bin failed after 3 attempts \(EndpointConnectionError\)"):
        storage.put_dir(new, "export-2")
    chaos.up()
    assert not storage.exists("export-2")  # half uploaded, never complete
    assert storage.get_text("LATEST") == "export-1"
    storage.get_dir("export-1", tmp_path / "old")
    assert (tmp_path / "old" / "a.bin").read_bytes() == b"old"
    storage.put_dir(new, "export-2")  # the endpoint is back: the upload completes
    storage.get_dir("export-2", tmp_path / "again")


def test_a_retried_upload_of_a_complete_directory_writes_nothing(chaos, tmp_path):
    storage = open_storage("s3://chaos/runs")
    source = make_dir(tmp_path / "src", {"a.bin": b"a", "b.bin": b"b"})
    storage.put_dir(source, "export-1")
    before = len(chaos.log)
    storage.put_dir(source, "export-1")  # e.g. the export task retried after its pointer update failed
    assert [m for _, m, _, _ in chaos.log[before:]] == ["GET", "HEAD", "HEAD"]  # manifest, then each file checked
    chaos.fail("503", times=100, method="DELETE")
    storage.put_dir(source, "export-1")  # so it never takes the complete directory out of view


@pytest.fixture()
def prefect_api():
    with prefect_test_harness(server_startup_timeout=90):
        yield


def test_the_pipeline_rides_out_a_flaky_endpoint(tiny_models, tmp_path, chaos, prefect_api):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    uninterrupted = exported_weights(train_pipeline(spec_for(tiny_models, tmp_path, checkpoint_steps=1,
                                                             storage=str(tmp_path / "clean"))))
    spec = spec_for(tiny_models, tmp_path, checkpoint_steps=1, storage="s3://chaos/runs")
    chaos.fail("503", times=2, method="PUT", path="/final-")
    chaos.fail("drop", times=ATTEMPTS, method="PUT", path="/partial/")  # the first checkpoint upload fails
    state = train_pipeline(spec, return_state=True)
    assert state.is_completed()
    assert [f["left"] for f in chaos.faults] == [0, 0]

    async def run_counts():
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
        return {run.name: run.run_count for run in runs}

    counts = asyncio.run(run_counts())
    assert counts["stage-00-policy"] == 2  # the storage error was retried as a task, from its last checkpoint
    result = state.result()
    storage = open_storage(spec.storage)
    storage.get_dir(result["key"], tmp_path / "export")
    assert same_weights(exported_weights({"uri": tmp_path / "export"}), uninterrupted)
    print(f"\npipeline: {2 + ATTEMPTS} S3 faults, task attempts {counts}, weights identical to an uninterrupted run")


def _run_disk_full(tmp_path: Path, model: str) -> tuple[dict, str]:
    """The disk-full script on a real 2.5 MiB tmpfs where one can be mounted, else with injected ENOSPC."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    script = [sys.executable, str(TESTS / "disk_full.py"), str(mount), model]
    if shutil.which("unshare") and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0:
        command = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=2560k tmpfs "{mount}" && exec "$@"',
                   "sh", *script]
        mode = "real tmpfs (2.5 MiB)"
    else:
        command, mode = [*script, "--inject"], "injected ENOSPC"
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[0][len("REPORT "):]), mode


def test_a_full_disk_fails_clearly_and_keeps_earlier_checkpoints(tiny_models, tmp_path):
    report, mode = _run_disk_full(tmp_path, tiny_models["qwen2-tiny"])
    for what, error in (("store", report["store_error"]), ("train", report["train_error"])):
        assert error is not None, f"{what}: the disk never filled"
        assert error["type"] == "OSError" and error["errno"] == 28, error
        assert "no space left on the device holding" in error["message"] and "untouched" in error["message"]
    assert report["store"] == {"visible": ["export-1"], "leftovers": []}  # verified, nothing half-written
    checkpoints = report["checkpoints"]
    assert checkpoints["visible"] and checkpoints["leftovers"] == []  # the ones that fit verify
    print(f"\ndisk full ({mode}): {len(checkpoints['visible'])} checkpoints fitted and verify; the next failed "
          f"with: {report['train_error']['message'][:100]}...")
