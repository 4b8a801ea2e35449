"""The small JSON file that identifies a training checkpoint.

It is read on its own, without checksums or loading weights, so tools and users can cheaply ask
which trainer wrote a checkpoint, how far it got and which W&B run to resume into.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .atomic import CheckpointError

CHECKPOINT_VERSION = 1
METADATA = "checkpoint.json"

_FIELDS = ("version", "trainer_class", "sequence", "run_id", "wandb")
_WANDB_KEYS = ("id", "project", "entity")
_HEX = re.compile(r"[0-9a-fA-F]+")


def write_metadata(
    directory: str | Path,
    *,
    trainer_class: str,
    sequence: int,
    run_id: str,
    wandb: dict | None,
    extra: dict | None = None,
) -> None:
    """Write ``checkpoint.json`` into ``directory`` (a :func:`publish_dir` staging directory).

    The fields are validated with the reader's rules so a checkpoint is never written that
    :func:`read_checkpoint_metadata` would reject.
    """
    extra = dict(extra or {})
    clash = sorted(set(_FIELDS) & extra.keys())
    if clash:
        raise ValueError(f"write_metadata(extra=...) must not set {clash}: those fields are passed by name.")
    body = {
        "version": CHECKPOINT_VERSION,
        "trainer_class": trainer_class,
        "sequence": sequence,
        "run_id": run_id,
        "wandb": wandb,
        **extra,
    }
    path = Path(directory) / METADATA
    _parse(body, path)
    path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")


def read_checkpoint_metadata(checkpoint: str | Path) -> dict:
    """Identity of a checkpoint: ``version``, ``trainer_class``, ``sequence``, ``run_id`` and ``wandb``.

    ``checkpoint`` is the checkpoint directory or its ``checkpoint.json``. ``wandb`` is ``None`` or
    ``{"id", optional "project", optional "entity"}``, ready to merge into a W&B config to resume
    the same run.
    """
    checkpoint = Path(checkpoint)
    path = checkpoint if checkpoint.name == METADATA else checkpoint / METADATA
    if not path.is_file():
        raise CheckpointError(
            f"{path} not found: {checkpoint} is not a training checkpoint "
            f"(pass a checkpoint directory or its {METADATA})."
        )
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}): the checkpoint metadata is corrupted.") from None
    return _parse(body, path)


def _parse(body, path: Path) -> dict:
    """Validate a metadata object and return just the five public fields."""
    if not isinstance(body, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not {type(body).__name__}.")
    missing = [field for field in _FIELDS if field not in body]
    if missing:
        raise CheckpointError(f"{path} is missing field(s) {missing}: it is not a complete checkpoint metadata file.")
    version = body["version"]
    if type(version) is not int or version != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"Unsupported checkpoint version {version!r} in {path} (field 'version'): this comlrl_core reads "
            f"version {CHECKPOINT_VERSION}; use the comlrl_core release that wrote it."
        )
    trainer_class = body["trainer_class"]
    if not isinstance(trainer_class, str) or not trainer_class:
        raise CheckpointError(f"{path}: field 'trainer_class' must be a non-empty string, got {trainer_class!r}.")
    sequence = body["sequence"]
    if type(sequence) is not int or sequence < 0:
        raise CheckpointError(f"{path}: field 'sequence' must be an integer >= 0, got {sequence!r}.")
    run_id = body["run_id"]
    if not isinstance(run_id, str) or _HEX.fullmatch(run_id) is None:
        raise CheckpointError(f"{path}: field 'run_id' must be a non-empty hex string, got {run_id!r}.")
    return {
        "version": version,
        "trainer_class": trainer_class,
        "sequence": sequence,
        "run_id": run_id,
        "wandb": _parse_wandb(body["wandb"], path),
    }


def _parse_wandb(wandb, path: Path) -> dict | None:
    """Keep only the keys that identify a W&B run, so merging them into a config cannot change anything else."""
    if wandb is None:
        return None
    if not isinstance(wandb, dict) or not isinstance(wandb.get("id"), str) or not wandb["id"]:
        raise CheckpointError(
            f"{path}: field 'wandb' must be null or an object with a non-empty string 'id', got {wandb!r}."
        )
    return {key: wandb[key] for key in _WANDB_KEYS if isinstance(wandb.get(key), str) and wandb[key]}
