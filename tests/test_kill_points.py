"""SIGKILL the pipeline at many points on S3 storage, re-running the flow after each kill.

Each run is killed at the next point of ``CHAIN`` (see ``kill_points.py``), then resumes from what the
killed runs left. After every kill the whole run prefix is audited: every directory that looks
complete (has its manifest) downloads and verifies, completed stages are never lost, and ``LATEST``
names a complete export. The last run finishes and its export is bit-identical to a run that was
never interrupted.
"""

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from prefect.settings import get_current_settings
from prefect.testing.utilities import prefect_test_harness

from comlrl_core.storage import open_storage
from flows.pipeline import train_pipeline
from helpers import exported_weights, s3_server, same_weights, spec_for

TESTS = Path(__file__).parent
# (point, N): the N-th time a run reaches the point, counted from the start of that run.
CHAIN = [
    ("rollout", 3),             # between two generate calls of one rollout
    ("optimizer-step", 3),      # parameters updated in memory, not yet checkpointed
    ("checkpoint-write", 2),    # weights written into the staging directory, state.pt not yet
    ("manifest-write", 2),      # half a manifest on disk in the staging directory
    ("publish-rename", 2),      # everything written, the final rename not done
    ("partial-upload", 2),      # some files of a checkpoint uploaded, its manifest not
    ("download", 2),            # while fetching the checkpoint to resume from
    ("final-upload", 1),        # while a stage publishes its final checkpoint
    ("optimizer-step", 5),
    ("export-upload", 2),       # while the export is uploaded
    ("pointer", 1),             # export complete, LATEST not yet moved
]
_LEAF = re.compile(r"checkpoint-\d+|final-.+|export-.+")


@pytest.fixture(scope="module", autouse=True)
def prefect_api():
    with prefect_test_harness(server_startup_timeout=90):
        yield


def audit(storage, key: str, scratch: Path) -> dict:
    """Download and verify every complete directory under ``key``; count the incomplete ones."""
    found = {"verified": 0, "incomplete": set(), "stages_done": set()}

    def walk(prefix: str) -> None:
        for name in storage.list_dirs(prefix):
            child = f"{prefix}/{name}"
            if not _LEAF.fullmatch(name):
                walk(child)
            elif storage.exists(child):
                storage.get_dir(child, scratch / uuid.uuid4().hex)  # raises on any missing or corrupt file
                found["verified"] += 1
                if name.startswith("final-"):
                    found["stages_done"].add(prefix)
            else:
                found["incomplete"].add(child)  # an interrupted upload: no manifest, so no reader uses it

    walk(key)
    return found


def test_killed_at_every_point_the_flow_resumes_to_identical_weights(tiny_models, tmp_path, monkeypatch):
    def make_spec(storage):
        return spec_for(tiny_models, tmp_path, checkpoint_steps=1, storage=storage,
                        config={"num_train_epochs": 3}, train_dataset={"builtin": "length_ratio", "size": 3})

    uninterrupted = exported_weights(train_pipeline(make_spec(str(tmp_path / "clean"))))
    with s3_server(monkeypatch, "kills"):
        spec = make_spec("s3://kills/runs")
        spec_file = tmp_path / "spec.yaml"
        spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
        work = tmp_path / "work"
        work.mkdir()
        env = {**os.environ, "PREFECT_API_URL": str(get_current_settings().api.url), "COMLRL_WORK_DIR": str(work),
               "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        storage = open_storage(spec.storage)
        done_before, incomplete_seen, verified = set(), set(), 0
        for i, (point, n) in enumerate(CHAIN):
            log = tmp_path / f"kill-{i}.log"
            with open(log, "w") as out:
                code = subprocess.run([sys.executable, "-m", "kill_points", "run", str(spec_file)],
                                      env={**env, "COMLRL_KILL_AT": f"{point}:{n}"}, stdout=out,
                                      stderr=subprocess.STDOUT, timeout=600).returncode
            assert code == -9, f"run {i} was not killed at {point}:{n} (exit {code}):\n{log.read_text()[-3000:]}"
            found = audit(storage, spec.run_key, tmp_path / "audit")
            assert found["stages_done"] >= done_before, f"a completed stage was lost after the kill at {point}"
            done_before = found["stages_done"]
            incomplete_seen |= found["incomplete"]
            verified += found["verified"]
            latest = storage.get_text(f"{spec.name}/LATEST")
            assert latest is None or storage.exists(json.loads(latest)["key"])

        final = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(spec_file)], env=env,
                               capture_output=True, text=True, timeout=600)
        assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
        export = next(line.split(": ", 1)[1] for line in final.stdout.splitlines() if line.startswith("export: "))
        key = export.removeprefix(storage.uri() + "/")
        storage.get_dir(key, tmp_path / "export")
        resumed = exported_weights({"uri": tmp_path / "export"})
        assert same_weights(resumed, uninterrupted)
        assert json.loads(storage.get_text(f"{spec.name}/LATEST"))["key"] == key
        leftovers = sorted(p.name for p in work.iterdir())
        assert leftovers == [], f"killed runs' scratch directories were not cleaned up: {leftovers}"
    print(f"\nkill points exercised: {len(CHAIN)} ({len({p for p, _ in CHAIN})} kinds), resumes: {len(CHAIN)}, "
          f"complete directories verified: {verified}, interrupted uploads seen (never read): {len(incomplete_seen)}, "
          f"completed stages: {len(done_before)}, weight mismatches: 0")
