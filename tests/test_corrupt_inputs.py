"""Corrupt inputs on disk, swept systematically: every file of a real checkpoint truncated, bit-flipped or
deleted, a manifest whose checksums lie, another run's or trainer's checkpoint, agent directories missing
a file, and damaged checkpoints in the pipeline's storage.

Each is refused with a message naming the file. Only ``"latest"`` — which the pipeline's resume always
is — falls back to the newest checkpoint that verifies.
"""

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogWorker
from prefect.testing.utilities import prefect_test_harness

from comlrl_core.checkpoint import MANIFEST, CheckpointError
from comlrl_core.environments import length_ratio_dataset, length_ratio_reward
from comlrl_core.storage import open_storage
from comlrl_core.trainers.checkpointing import latest_checkpoint
from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from flows.pipeline import train_pipeline
from helpers import damage_consistently, exported_weights, same_weights, spec_for


def make(agent_model: str) -> MAGRPOTrainer:
    return MAGRPOTrainer(agent_model=agent_model, num_agents=2, reward_func=length_ratio_reward,
                         train_dataset=length_ratio_dataset(2),
                         args=MAGRPOConfig(num_train_epochs=1, max_new_tokens=4, num_generations=2,
                                           rollout_buffer_size=1, verbose=False))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGES = {"truncated": truncate, "bit-flipped": flip_bit, "deleted": Path.unlink}


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    """A MAGRPO run that checkpointed after each of its two steps."""
    directory = tmp_path_factory.mktemp("checkpoints") / "ck"
    make(tiny_models["qwen2-tiny"]).train(checkpoint_dir=directory, checkpoint_steps=1)
    assert sorted(p.name for p in directory.iterdir()) == ["checkpoint-1", "checkpoint-2"]
    return directory


def test_every_file_of_a_checkpoint_damaged_every_way_is_refused_naming_it(tiny_models, checkpoints, tmp_path):
    trainer = make(tiny_models["qwen2-tiny"])
    files = sorted(p.relative_to(checkpoints / "checkpoint-2").as_posix()
                   for p in (checkpoints / "checkpoint-2").rglob("*") if p.is_file())
    cases = 0
    for rel in files:
        for how, damage in {**DAMAGES, "listed with a wrong checksum": None}.items():
            if damage is None and rel == MANIFEST:
                continue
            work = tmp_path / f"case-{cases}"
            shutil.copytree(checkpoints, work)
            target = work / "checkpoint-2"
            if damage is None:
                manifest = json.loads((target / MANIFEST).read_text())
                manifest["files"][rel]["sha256"] = "0" * 64
                (target / MANIFEST).write_text(json.dumps(manifest))
            else:
                damage(target / rel)
            with pytest.raises(CheckpointError) as refused:  # an explicit path is never silently replaced
                trainer.load_checkpoint(target)
            named = target if rel == MANIFEST else target / rel  # a damaged manifest may name any file it lists
            assert str(named) in str(refused.value), f"{rel} {how}: {refused.value}"
            assert latest_checkpoint(work) == work / "checkpoint-1", f"{rel} {how}: 'latest' did not fall back"
            cases += 1
    assert cases == len(files) * 4 - 1
    print(f"\ncorrupt checkpoints: {cases} damaged ({len(files)} files x truncated/bit-flipped/deleted/wrong "
          f"checksum), {cases} refused naming the file, {cases} 'latest' fell back to checkpoint-1")


def test_latest_resume_continues_from_the_newest_valid_checkpoint(tiny_models, checkpoints, tmp_path):
    work = tmp_path / "ck"
    shutil.copytree(checkpoints, work)
    flip_bit(work / "checkpoint-2" / "state.pt")
    with pytest.raises(CheckpointError, match="state.pt"):
        make(tiny_models["qwen2-tiny"]).train(resume_from_checkpoint=work / "checkpoint-2")
    resumed = make(tiny_models["qwen2-tiny"])
    resumed.train(resume_from_checkpoint="latest", checkpoint_dir=work, checkpoint_steps=1)
    assert resumed.progress.sequence == 2  # it redid step 2 from checkpoint-1


def test_another_runs_checkpoints_are_never_written_over(tiny_models, checkpoints, tmp_path):
    work = tmp_path / "ck"
    shutil.copytree(checkpoints, work)
    with pytest.raises(FileExistsError, match="checkpoint-1 of another run"):
        make(tiny_models["qwen2-tiny"]).train(checkpoint_dir=work, checkpoint_steps=1)
    assert latest_checkpoint(work) == work / "checkpoint-2"


@pytest.mark.parametrize("missing, named", [("tokenizer.json", "tokenizer.json"), ("config.json", "config.json"),
                                            ("model.safetensors", "model.safetensors")])
def test_an_agent_directory_missing_a_file_is_refused_naming_it(tiny_models, tmp_path, missing, named):
    agent = tmp_path / "agent"
    shutil.copytree(tiny_models["qwen2-tiny"], agent)
    (agent / missing).unlink()
    with pytest.raises((ValueError, OSError), match=named):
        make(str(agent))


def test_truncated_agent_weights_are_refused_naming_the_file(tiny_models, tmp_path):
    agent = tmp_path / "agent"
    shutil.copytree(tiny_models["qwen2-tiny"], agent)
    truncate(agent / "model.safetensors")
    with pytest.raises(ValueError, match=f"corrupt or truncated \\({agent / 'model.safetensors'}"):
        make(str(agent))


# ---- in the pipeline's storage ------------------------------------------------------------------------

@pytest.fixture()
def prefect_api():
    with prefect_test_harness(server_startup_timeout=90):
        yield


def flow_logs(state) -> str:
    """Every log line of a flow run and its task runs, read back from the Prefect API."""
    APILogWorker.drain_all(timeout=10)  # logs go to the API in batches, in the background

    async def read() -> str:
        async with get_client() as client:
            logs = await client.read_logs(log_filter=LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
        return "\n".join(log.message for log in logs)

    return asyncio.run(read())


def test_the_pipeline_recomputes_corrupt_cached_outputs_and_skips_a_corrupt_checkpoint(tiny_models, tmp_path,
                                                                                      prefect_api):
    spec = spec_for(tiny_models, tmp_path, checkpoint_steps=1)
    storage = open_storage(spec.storage)
    first = train_pipeline(spec)
    clean = exported_weights(first)
    [stage0, stage1] = sorted(d for d in storage.list_dirs(spec.run_key) if d.startswith("stage-"))
    final0 = next(d for d in storage.list_dirs(f"{spec.run_key}/{stage0}") if d.startswith("final-"))
    damaged = storage.uri(f"{spec.run_key}/{stage0}/{final0}")
    # A cache hit is verified before it is trusted: a damaged export, then a damaged stage output, is
    # deleted with a warning naming it and computed again, to the same weights.
    for path in (Path(first["uri"]) / "agent_1" / "model.safetensors", Path(damaged) / "agents" / "0.safetensors"):
        flip_bit(path)
        again = train_pipeline(spec, return_state=True)
        assert again.is_completed()
        assert f"{str(path).split('/agent')[0]} no longer matches its manifest" in flow_logs(again)
        assert same_weights(exported_weights(again.result()), clean)
        latest = json.loads(storage.get_text(f"{spec.name}/LATEST"))["key"]
        assert storage.intact(latest)
    assert all(storage.intact(f"{spec.run_key}/{stage}/{d}") for stage in (stage0, stage1)
               for d in storage.list_dirs(f"{spec.run_key}/{stage}") if d.startswith("final-"))

    final0 = next(d for d in storage.list_dirs(f"{spec.run_key}/{stage0}") if d.startswith("final-"))
    storage.delete(f"{spec.run_key}/{stage0}/{final0}")  # stage 0 must run again...
    partial = f"{spec.run_key}/{stage0}/partial"
    checkpoints = [f"{partial}/{owner}/{name}" for owner in storage.list_dirs(partial)
                   for name in storage.list_dirs(f"{partial}/{owner}")]
    last = max(int(k.rsplit("-", 1)[1]) for k in checkpoints)
    newest = [k for k in checkpoints if int(k.rsplit("-", 1)[1]) == last]  # one per run of the stage
    for key in newest:  # ...and its newest checkpoints are damaged too, under manifests rewritten to match
        damage_consistently(Path(storage.uri(key)), "truncated-weights")
    recovered = train_pipeline(spec, return_state=True)
    assert recovered.is_completed()
    logs = flow_logs(recovered)
    for key in newest:
        assert f"Skipping checkpoint {storage.uri(key)}: {storage.uri(key)}/agents/0.safetensors is not a " \
               "readable safetensors file" in logs
    assert same_weights(exported_weights(recovered.result()), clean)
