"""One Prefect task per pipeline stage. Each returns a short reference, never a model object.

A stage restores the trainer from the previous stage's checkpoint, works up to its checkpoint
boundary, publishes the checkpoint to the run's storage and returns ``{"key", "uri", "digest"}``.
Cache keys hash the spec, the stage and the *content* digests of the inputs (checkpoint manifests,
entity fingerprints), so a changed upstream input always recomputes downstream. Checkpoints
written inside a stage are uploaded as they appear, so a failed stage resumes from its last one,
on this worker or another. The last stage also publishes the export from its own trained trainer;
the export task rebuilds it from the final checkpoint only when that did not happen.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE
from prefect.states import Failed

from comlrl_core.checkpoint import CheckpointError, sha256_file
from comlrl_core.checkpoint.atomic import process_alive, process_tag
from comlrl_core.plots import plot_history
from comlrl_core.storage import StorageError, open_storage
from comlrl_core.trainers.checkpointing import (
    check_loadable,
    checkpoint_sequence,
    latest_checkpoint,
    list_checkpoints,
)
from comlrl_core.trainers.data import build_formatters, check_formatters, dataset_fingerprint

from .launch import accelerate_command, run_streaming
from .spec import ALGORITHMS, RunSpec

STAGE_CACHE = INPUTS + TASK_SOURCE  # no run id: completed stages are reused by later flow runs


def plain_failures(func):
    """An expected error (a bad spec, dataset or checkpoint) fails the task with its message alone,
    which Prefect logs without a traceback (kept at debug level); anything else still raises."""
    @functools.wraps(func)
    def run(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except (ValueError, TypeError, FileNotFoundError) as exc:
            get_run_logger().debug("%s failed:", func.__name__, exc_info=True)
            return Failed(message=f"{type(exc).__name__}: {exc}", data=exc)
    return run


def _transient(task, task_run, state) -> bool:
    """Retry storage and network failures; a bad spec or corrupt checkpoint fails at once."""
    try:
        state.result()
    except (StorageError, ConnectionError, TimeoutError):
        return True
    except Exception:  # noqa: BLE001 - everything else is deterministic
        return False
    return False


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _ref(storage, key: str) -> dict:
    """A published directory by location and content (the sha256 of its manifest)."""
    return {"key": key, "uri": storage.uri(key), "digest": _digest(storage.read_manifest(key))}


def _fetch(storage, ref: dict, into: Path, loadable: bool = False) -> Path:
    """Download a referenced directory, refusing (and removing) one whose content is not what was
    referenced or, with ``loadable``, a checkpoint whose files do not load; errors name the stored copy."""
    fix = f"delete {ref['uri']} and re-run the flow: the stage that wrote it runs again"
    try:
        manifest = storage.get_dir(ref["key"], into)
        if loadable:
            check_loadable(into)
    except CheckpointError as exc:
        shutil.rmtree(into, ignore_errors=True)
        raise CheckpointError(f"{str(exc).replace(str(into), ref['uri'])} To recover, {fix}.") from None
    if _digest(manifest) != ref["digest"]:
        shutil.rmtree(into)
        raise CheckpointError(f"{ref['uri']} changed after it was produced (manifest digest differs); {fix}.")
    return into


def cached_problem(spec: RunSpec, ref: dict) -> str | None:
    """Why a cached stage or export result can no longer be trusted, or None. A directory whose files
    no longer match its manifest (a flipped bit, a truncated or added file) is removed, so the rerun
    that follows computes it again instead of finding it."""
    storage = open_storage(spec.storage)
    if not storage.exists(ref["key"]):
        return f"{ref['uri']} is gone from storage"
    if not storage.intact(ref["key"]):
        storage.delete(ref["key"])
        return f"{ref['uri']} no longer matches its manifest (a file was corrupted, removed or added); it was deleted"
    if _digest(storage.read_manifest(ref["key"])) != ref["digest"]:
        return f"{ref['uri']} was replaced by other content"
    return None


def plan_stages(spec: RunSpec) -> list[dict]:
    """The stage list: preference stages where the algorithm has them, then training in
    ``stage_epochs`` chunks (one chunk per iteration for MARLHFIter)."""
    config = spec.trainer_config()
    stages = []

    def policy_chunks(prefix: dict):
        total = config.num_train_epochs
        for end in range(spec.stage_epochs, total + spec.stage_epochs, spec.stage_epochs):
            stages.append({**prefix, "kind": "policy", "epochs": min(end, total)})

    if spec.algorithm == "marlhf_iter":
        for iteration in range(config.num_iterations):
            for kind in ("collect", "fit", "policy"):
                stages.append({"kind": kind, "iteration": iteration})
    elif spec.algorithm == "marlhf":
        stages += [{"kind": "collect"}, {"kind": "fit"}]
        policy_chunks({})
    else:
        policy_chunks({})
    return [{**stage, "index": i} for i, stage in enumerate(stages)]


def _fingerprint(source: str) -> dict:
    """A source's content identity: the sha256 of every file of a directory (wherever it lies), or a hub id."""
    path = Path(source).expanduser()
    if not path.is_dir():
        return {"id": source}  # a hub id: its name is its identity here (nothing is downloaded)
    return {"files": {p.relative_to(path).as_posix(): sha256_file(p) for p in sorted(path.rglob("*")) if p.is_file()}}


def _initial_export(spec: RunSpec, storage) -> dict | None:
    """The export a retraining run starts from: ``init_from`` ("latest", or an export key), if any."""
    if spec.init_from is None:
        return None
    if spec.init_from == "latest":
        pointer = storage.get_text(f"{spec.name}/LATEST")
        if pointer is None:
            return None  # the first run of a retraining schedule starts from agent_model/agents
        return _ref(storage, _pointed_export(storage, f"{spec.name}/LATEST", pointer))
    if not storage.exists(spec.init_from):
        raise ValueError(f"init_from={spec.init_from!r}: no complete export there in {spec.storage}.")
    return _ref(storage, spec.init_from)


def _pointed_export(storage, pointer_key: str, text: str) -> str:
    """The export key a ``LATEST`` pointer names, checked: its digest (which names a local cache
    directory) is recomputed from the export itself, never taken from the pointer."""
    try:
        key = json.loads(text)["key"]
        if storage.exists(key):
            return key
    except (ValueError, TypeError, KeyError):  # not JSON, not an object, no key, or an unsafe key
        pass
    raise ValueError(f"{storage.uri(pointer_key)} does not name a complete export: it is corrupt or was "
                     "tampered with; delete it (the next run starts from agent_model/agents) or rewrite it.")


def initial_agents(spec: RunSpec, init: dict | None) -> list[str] | None:
    """Local directories of the initial export's agents (downloaded once per export digest)."""
    if init is None:
        return None
    cache = Path(os.environ.get("COMLRL_CACHE_DIR", Path.home() / ".cache" / "comlrl")) / "exports" / init["digest"]
    if not cache.is_dir():
        _fetch(open_storage(spec.storage), init, cache)
    return [str(cache / f"agent_{i}") for i in range(len(list(cache.glob("agent_*"))))]


@task(name="resolve-entities", cache_policy=NO_CACHE)
@plain_failures
def resolve_entities(spec: RunSpec) -> dict:
    """Check every seed rule (configs and tokenizers only), fingerprint the sources' files and the data,
    and pin the export a retraining run starts from; downstream cache keys include all of it."""
    spec.check_storage()
    storage = open_storage(spec.storage)
    for leftover in storage.remove_stale(spec.name):
        get_run_logger().info("Removed %s, left by a writer that was killed.", leftover)
    init = _initial_export(spec, storage)
    agents = initial_agents(spec, init)
    trainer_class = ALGORITHMS[spec.algorithm][0]
    plan = trainer_class.check_entities(spec.trainer_config(), agent_model=None if agents else spec.agent_model,
                                        agents=agents or spec.agents, num_agents=spec.num_agents,
                                        tokenizer=spec.load_tokenizers(), model_config=spec.model_options,
                                        critic_model=spec.critic_model, critics=spec.critics)
    sources = [s for s in [*plan.agent_sources, *plan.critic_sources, plan.reward_model_source] if s]
    train = spec.train_dataset.load("train_dataset")
    held_out = spec.eval_dataset.load("eval_dataset") if spec.eval_dataset else None
    # Their prompt fields and chat templates, before any stage loads weights.
    check_formatters(build_formatters(spec.formatter_objects(), plan.num_agents, plan.tokenizers), train, held_out)
    manifest = {"num_agents": plan.num_agents, "init": init,
                "sources": [_fingerprint(s) for s in dict.fromkeys(sources)],
                "data": {"train": dataset_fingerprint(train), "eval": dataset_fingerprint(held_out)}}
    get_run_logger().info("Resolved %d agents from %d source(s)%s.", plan.num_agents, len(manifest["sources"]),
                          f", starting from export {init['key']}" if init else "")
    return manifest


def _work_dir() -> tempfile.TemporaryDirectory:
    """Scratch space for one stage, named by host and pid so a later stage can remove what a killed
    process (SIGKILL, the OOM killer) left behind instead of filling the disk run after run."""
    root = Path(os.environ.get("COMLRL_WORK_DIR") or tempfile.gettempdir())
    host = process_tag().rsplit("-", 1)[0]
    for stale in root.glob(f"comlrl-stage-{host}-*-*"):
        pid = stale.name[len(f"comlrl-stage-{host}-"):].split("-")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"comlrl-stage-{process_tag()}-", dir=root)


def _owner() -> str:
    """Who writes: this attempt of the flow run (a retry, even one racing a stalled original, writes
    beside it, never into the same files), else a fresh id."""
    from prefect.runtime import flow_run

    if flow_run.id is None:
        return uuid.uuid4().hex
    return f"{flow_run.id}-{flow_run.run_count}"


def _latest_partial(storage, key: str, into: Path) -> Path | None:
    """Download the newest valid checkpoint any run of this stage uploaded before it stopped.

    Incomplete uploads (no manifest) are skipped; a corrupt one, or one whose files do not load even
    though they match its manifest, is skipped with a warning naming the stored checkpoint, so a
    resume falls back to the newest checkpoint that loads.
    """
    found = [(checkpoint_sequence(Path(name)), f"{owner}/{name}") for owner in storage.list_dirs(key)
             for name in storage.list_dirs(f"{key}/{owner}") if checkpoint_sequence(Path(name)) is not None]
    for _, rel in sorted(found, reverse=True):
        stored, local = f"{key}/{rel}", into / Path(rel).name
        try:
            if not storage.exists(stored):
                continue
            storage.get_dir(stored, local)
            check_loadable(local)
        except CheckpointError as exc:
            shutil.rmtree(local, ignore_errors=True)
            get_run_logger().warning("Skipping checkpoint %s: %s", storage.uri(stored),
                                     str(exc).replace(str(local), storage.uri(stored)))
            continue
        return local
    return None


def _finished(storage, stage_key: str) -> str | None:
    """A published final checkpoint of this stage from any run (the fallback when the cache is lost)."""
    for name in storage.list_dirs(stage_key):
        key = f"{stage_key}/{name}"
        if name.startswith("final-") and storage.exists(key):
            if storage.intact(key):
                return key
            get_run_logger().warning("Deleting %s: its files no longer match its manifest.", storage.uri(key))
            storage.delete(key)
    return None


def _stage_overrides(spec: RunSpec, stage: dict) -> tuple[dict, dict]:
    """Config overrides and ``train()`` arguments that stop the trainer at this stage's boundary."""
    if spec.algorithm == "marlhf_iter":
        config = {"num_iterations": stage["iteration"] + 1}
    else:
        config = {"num_train_epochs": stage["epochs"]} if stage["kind"] == "policy" else {}
    stop = {"stop_after": stage["kind"]} if stage["kind"] in ("collect", "fit") else {}
    return config, stop


@task(name="training-stage", task_run_name="stage-{stage[index]:02d}-{stage[kind]}", cache_policy=STAGE_CACHE,
      persist_result=True, retries=2,
      retry_delay_seconds=[2, 10], retry_condition_fn=_transient)
@plain_failures
def run_stage(spec: RunSpec, stage: dict, previous: dict | None, entities: dict) -> dict:
    """Run one stage to its checkpoint boundary; returns the published checkpoint's reference. The last
    stage, once it has trained, publishes the export too: its trainer already holds the final models."""
    logger = get_run_logger()
    storage = open_storage(spec.storage)
    # Keyed by the inputs' content, so changed weights or an upstream rerun never find stale checkpoints.
    inputs = _digest({"entities": entities, "previous": previous and previous["digest"], "stage": stage})
    stage_key = f"{spec.run_key}/stage-{stage['index']:02d}-{stage['kind']}-{inputs[:12]}"
    finished = _finished(storage, stage_key)
    if finished is not None:  # completed before, but the Prefect cache was lost
        return _ref(storage, finished)
    owner = _owner()  # runs of one spec at the same time write into separate directories
    with _work_dir() as work:
        work = Path(work)
        resume = _latest_partial(storage, f"{stage_key}/partial", work / "partial")
        if resume is not None:
            logger.info("Resuming stage %s from its checkpoint %s.", stage_key, resume.name)
        elif previous is not None:
            resume = _fetch(storage, previous, work / "previous", loadable=True)
        job = {"stage": stage, "stage_key": stage_key, "owner": owner, "agents": initial_agents(spec, entities["init"]),
               "resume": resume and str(resume), "work": str(work)}
        if spec.num_processes == 1:
            return train_stage(spec, job, logger.info)
        (work / "job.json").write_text(json.dumps({**job, "spec": spec.model_dump(mode="json")}))
        logger.info("Launching stage %s on %d processes.", stage_key, spec.num_processes)
        run_streaming(accelerate_command(spec.num_processes, ["-m", "tasks.stage_worker", str(work / "job.json")]),
                      logger.info)
        return json.loads((work / "result.json").read_text())


def train_stage(spec: RunSpec, job: dict, log) -> dict | None:
    """Train one stage from ``job`` (what :func:`run_stage` resolved) and publish its final checkpoint,
    and the export after the last stage; returns its reference. Every process of a data-parallel stage
    runs this; rank 0 uploads and returns the reference, the others return None."""
    stage, stage_key = job["stage"], job["stage_key"]
    storage, work, resume = open_storage(spec.storage), Path(job["work"]), job["resume"] and Path(job["resume"])
    overrides, stop = _stage_overrides(spec, stage)
    trainer = spec.build_trainer(job["agents"], **overrides)
    checkpoints = work / "checkpoints"
    held = {}  # the history the newest checkpoint holds: the trainer may log an evaluation after it

    def upload(path: Path) -> None:  # rank 0 only: only it writes checkpoints
        storage.put_dir(path, f"{stage_key}/partial/{job['owner']}/{path.name}")
        held["history"] = list(trainer.history)
        held["samples"] = list(trainer.eval_samples)
        log(f"Checkpoint {path.name} of stage {stage_key} uploaded.")

    trainer.train(resume_from_checkpoint=resume, checkpoint_dir=checkpoints,
                  checkpoint_steps=spec.checkpoint_steps, on_checkpoint=upload, **stop)
    last = stage == plan_stages(spec)[-1]
    if last:
        trainer.save_model(work / "export")  # every rank calls it; rank 0 writes
    if not trainer.dist.is_main:
        return None
    # Resumed from a checkpoint at the stage's boundary (killed while publishing the final one)
    # leaves nothing to train: that checkpoint is the final one, exported by the export task.
    final = latest_checkpoint(checkpoints) if list_checkpoints(checkpoints) else resume
    storage.put_dir(final, f"{stage_key}/final-{job['owner']}")
    ref = _ref(storage, f"{stage_key}/final-{job['owner']}")
    log(f"Stage {stage_key} complete: {ref['uri']}")
    if last and "history" in held:
        export_key = _export_key(spec, ref)
        _publish_export(spec, storage, held["history"], held["samples"], export_key, work)
        log(f"Export {storage.uri(export_key)} published.")
    return ref


def _export_key(spec: RunSpec, final: dict) -> str:
    return f"{spec.run_key}/export-{final['digest'][:12]}"


def _publish_export(spec: RunSpec, storage, history: list[dict], samples: list[dict], export_key: str,
                    work: Path) -> Path:
    """Publish the ``save_model`` output in ``work/export`` under ``export_key``, then the report (the history
    and eval samples the final checkpoint holds, and its reward curve) beside it; returns the local report.
    The last stage and the export task both publish through here, so their files are identical."""
    storage.put_dir(work / "export", export_key)
    report = work / "report"
    report.mkdir()
    (report / "history.json").write_text(json.dumps(history))
    (report / "samples.json").write_text(json.dumps(samples))
    plot_history(history, report / "reward_curve.png", title=f"{spec.name} ({spec.algorithm})")
    storage.put_dir(report, f"{export_key}-report")
    return report


def _stored_report(storage, export_key: str, into: Path) -> Path | None:
    """The report of a complete export, downloaded (and verified); None when the export or an intact
    report holding the history is not in storage."""
    if not (storage.exists(export_key) and storage.intact(f"{export_key}-report")):
        return None
    if "history.json" not in storage.read_manifest(f"{export_key}-report")["files"]:
        return None
    storage.get_dir(f"{export_key}-report", into)
    return into


def _export_checkpoint(spec: RunSpec, storage, final: dict, entities: dict, work: Path) -> Path:
    """The export rebuilt from the final checkpoint, for when its stage did not publish it (it was cut
    short or resumed at its boundary, or the export was deleted); returns the local report."""
    get_run_logger().info("Exporting %s from the final checkpoint %s.", _export_key(spec, final), final["uri"])
    trainer = spec.build_trainer(initial_agents(spec, entities["init"]))
    trainer.load_checkpoint(_fetch(storage, final, work / "final", loadable=True))
    trainer.save_model(work / "export")
    return _publish_export(spec, storage, trainer.history, trainer.eval_samples, _export_key(spec, final), work)


@task(name="export", cache_policy=STAGE_CACHE, persist_result=True, retries=2, retry_delay_seconds=[2, 10],
      retry_condition_fn=_transient)
@plain_failures
def export_models(spec: RunSpec, final: dict, entities: dict) -> dict:
    """The final checkpoint's export (published by the last stage, else built here), its metrics, and
    ``LATEST`` moved to it."""
    storage = open_storage(spec.storage)
    export_key = _export_key(spec, final)
    with _work_dir() as work:
        work = Path(work)
        report = _stored_report(storage, export_key, work / "stored")
        if report is None:
            report = _export_checkpoint(spec, storage, final, entities, work)
        history = json.loads((report / "history.json").read_text())
        samples = json.loads((report / "samples.json").read_text()) if (report / "samples.json").is_file() else []
        curve = (report / "reward_curve.png").is_file()
    exported = {**_ref(storage, export_key), "metrics": summarize(history), "samples": samples,
                "curve": storage.uri(f"{export_key}-report/reward_curve.png") if curve else None}
    # The "latest" pointer moves only once the new export is complete; older exports stay untouched.
    storage.put_text(f"{spec.name}/LATEST", json.dumps({k: exported[k] for k in ("key", "uri", "digest")}) + "\n")
    return exported


def summarize(history: list[dict]) -> dict:
    """Reward before -> after: the first and last evaluation when there is one, else the training
    reward (for a preference trainer without evaluation, the reward model's score, named as such)."""
    found = {}
    for key in ("eval/turn_1/reward_mean", "turn_1/reward_mean", "learned/turn_1/reward_mean"):
        values = [h[key] for h in history if key in h]
        if values:
            quarter = 1 if key.startswith("eval/") else max(len(values) // 4, 1)
            found = {"metric": key, "before": sum(values[:quarter]) / quarter,
                     "after": sum(values[-quarter:]) / quarter, "points": len(values)}
            break
    accuracy = [h["reward_model/heldout_accuracy"] for h in history if "reward_model/heldout_accuracy" in h]
    if found and accuracy:  # the last fitted reward model's
        found["reward_model_heldout_accuracy"] = accuracy[-1]
    return found
