"""The training pipeline: resolve entities, then each stage to its checkpoint (the last one exports its
trained models too), then the export task (the metrics, and ``LATEST`` moved to the export).

Re-running a spec after a failure (a new flow run, a flow retry, or ``prefect flow-run retry``)
skips the completed stages — they are cache hits — and the failed stage resumes from its last
checkpoint, so the exported weights equal those of a run that never failed.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.states import Failed
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tasks.spec import RunSpec
from tasks.stages import cached_problem, export_models, plan_stages, resolve_entities, run_stage


@flow(name="comlrl-train", log_prints=True)
def train_pipeline(spec: RunSpec) -> dict:
    """Train the agents a :class:`~tasks.spec.RunSpec` describes and export them to its storage."""
    try:
        return _pipeline(spec)
    except _TaskFailed as failure:  # the task logged it; the run ends on its message, with no second traceback
        return Failed(message=failure.state.message, data=failure.state.result(raise_on_failure=False))


def _pipeline(spec: RunSpec) -> dict:
    logger = get_run_logger()
    entities = _result(resolve_entities(spec, return_state=True))
    stages = plan_stages(spec)
    logger.info("Run %s: %d stages (%s) into %s", spec.run_key, len(stages),
                ", ".join(s["kind"] for s in stages), spec.storage)
    progress = create_progress_artifact(progress=0.0, key="comlrl-stages", description="Completed stages (%)")
    checkpoint = None
    for done, stage in enumerate(stages, start=1):
        checkpoint = _stored(run_stage, spec, stage, checkpoint, entities)
        update_progress_artifact(progress, progress=100.0 * done / len(stages))
    result = _stored(export_models, spec, checkpoint, entities)
    _publish_summary(spec, stages, checkpoint, result)
    return result


class _TaskFailed(Exception):
    def __init__(self, state):
        super().__init__(state.message)
        self.state = state


def _result(state):
    """A task's result; a failed task stops the flow with its state."""
    if state.is_failed():
        raise _TaskFailed(state)
    return state.result()


def _stored(stage_task, spec: RunSpec, *args) -> dict:
    """Run a cached task; a cache hit whose directory was since deleted, corrupted or replaced in
    storage is computed again instead of being trusted."""
    state = stage_task(spec, *args, return_state=True)
    result = _result(state)
    problem = cached_problem(spec, result) if state.name == "Cached" else None
    if problem is not None:
        get_run_logger().warning("%s; running %s again.", problem, stage_task.name)
        result = _result(stage_task.with_options(refresh_cache=True)(spec, *args, return_state=True))
    return result


def _publish_summary(spec: RunSpec, stages: list[dict], checkpoint: dict, result: dict) -> None:
    metrics = result.get("metrics", {})
    rows = [{"metric": metrics.get("metric", "-"), "before": metrics.get("before"), "after": metrics.get("after")}]
    create_table_artifact(key="comlrl-final-metrics", table=rows, description=f"{spec.algorithm} reward")
    lines = [
        f"# {spec.name}: {spec.algorithm}",
        "",
        f"- export: `{result['uri']}` (manifest digest `{result['digest'][:16]}`)",
        f"- final checkpoint: `{checkpoint['uri']}`",
        f"- stages: {len(stages)} ({', '.join(s['kind'] for s in stages)})",
    ]
    if metrics:
        lines.append(f"- {metrics['metric']}: {metrics['before']:.4f} -> {metrics['after']:.4f}")
        if "reward_model_heldout_accuracy" in metrics:
            lines.append(f"- reward model, held-out pair accuracy: {metrics['reward_model_heldout_accuracy']:.3f}")
    if result.get("curve"):
        lines.append(f"- reward and loss curve: `{result['curve']}`")
    if result.get("samples"):
        lines += ["", "## Sample completions (held-out items)", "", *sample_lines(result["samples"])]
    create_markdown_artifact(key="comlrl-run-summary", markdown="\n".join(lines), description="Run summary")


def sample_lines(records: list[dict], width: int = 240) -> list[str]:
    """The first and last evaluations' completions side by side, per eval item, as Markdown list lines."""
    def clip(text: str) -> str:
        text = " ".join(text.split())
        return text if len(text) <= width else text[:width - 1] + "…"

    labels = ["before", "after"] if len(records) > 1 else ["evaluated"]
    lines = []
    for n, sample in enumerate(records[0]["samples"]):
        lines.append(f"- prompt: {clip(sample['prompt'])}")
        for label, record in zip(labels, records):
            shown = record["samples"][n]
            lines.append(f"  - {label} (step {record['step']}, reward {shown['reward']:.3f}):")
            lines += [f"    - agent {i}: {clip(text) or '(empty)'}" for i, text in enumerate(shown["completions"])]
    return lines
