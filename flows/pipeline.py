"""The training pipeline: resolve entities, then each stage to its checkpoint (the last one exports its
trained models too), then the export task (the metrics, and ``LATEST`` moved to the export).

Re-running a spec after a failure (a new flow run, a flow retry, or ``prefect flow-run retry``)
skips the completed stages — they are cache hits — and the failed stage resumes from its last
checkpoint, so the exported weights equal those of a run that never failed.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tasks.spec import RunSpec
from tasks.stages import export_models, plan_stages, resolve_entities, run_stage, still_stored


@flow(name="comlrl-train", log_prints=True)
def train_pipeline(spec: RunSpec) -> dict:
    """Train the agents a :class:`~tasks.spec.RunSpec` describes and export them to its storage."""
    logger = get_run_logger()
    entities = resolve_entities(spec)
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


def _stored(stage_task, spec: RunSpec, *args) -> dict:
    """Run a cached task; when its cached result names a directory since deleted from storage (say, a
    corrupt one the user removed), compute it again instead of failing downstream."""
    result = stage_task(spec, *args)
    if not still_stored(spec, result):
        get_run_logger().warning("%s is gone from storage; running %s again.", result["uri"], stage_task.name)
        result = stage_task.with_options(refresh_cache=True)(spec, *args)
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
