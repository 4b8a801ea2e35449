"""``save_model`` exports: the seed's directory layouts, written atomically with a checksum manifest."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .checkpoint import MANIFEST, CheckpointError, publish_dir


@dataclass
class ExportEntry:
    """One loadable directory inside an export: a model, optionally its tokenizer and heads.

    ``heads`` maps a file name (``"value_head.pt"``, ``"reward_head.pt"``) to a module whose
    ``state_dict`` is saved there, loadable with ``torch.load(..., weights_only=True)``.
    """

    path: str  # relative, e.g. "agent_0" or "agent_0/critic"
    model: nn.Module
    tokenizer: object | None = None
    heads: dict[str, nn.Module] = field(default_factory=dict)


def export_models(output_dir: str | Path, entries: list[ExportEntry], info: dict) -> dict:
    """Write every entry under ``output_dir`` and publish it in one rename; returns the manifest.

    ``info`` (trainer class, sources, config, head architecture) goes into ``manifest.json``.
    An existing directory is replaced only when it is a previous export (it has our manifest):
    anything else there belongs to someone and is never deleted.
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not (output_dir / MANIFEST).is_file():
        raise CheckpointError(
            f"save_model: {output_dir} already exists and is not a previous export (no {MANIFEST}); "
            "choose an empty or new directory."
        )

    def write(staging: Path) -> None:
        for entry in entries:
            target = staging / entry.path
            entry.model.save_pretrained(target)
            if entry.tokenizer is not None:
                _save_tokenizer(entry.tokenizer, target)
            for name, head in entry.heads.items():
                torch.save(head.state_dict(), target / name)

    manifest = publish_dir(output_dir, write, extra={"export": json.loads(json.dumps(info, default=str))})
    return manifest


def _save_tokenizer(tokenizer, target: Path) -> None:
    """``save_pretrained`` without the truncation and padding an encoding call leaves on a fast tokenizer's
    backend: an export does not depend on what its trainer last encoded."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and (backend.truncation is not None or backend.padding is not None):
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.backend_tokenizer.no_truncation()
        tokenizer.backend_tokenizer.no_padding()
    tokenizer.save_pretrained(target)
