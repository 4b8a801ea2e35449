"""Training checkpoints: what a trainer writes at each boundary, and how a resume is checked and restored.

A checkpoint is one directory, published atomically with a checksum manifest: safetensors weights
per entity, ``state.pt`` (optimizers, RNG states, runtime buffers, callback states; loaded with
``weights_only=True``) and ``checkpoint.json`` (identity, progress, config and fingerprints).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import torch

from ..checkpoint import (
    METADATA,
    CheckpointError,
    capture_rng,
    check_tensors,
    is_staging_name,
    load_state,
    load_tensors,
    publish_dir,
    read_checkpoint_metadata,
    restore_rng,
    save_state,
    save_tensors,
    verify_dir,
    write_metadata,
)
from ..checkpoint.atomic import remove_stale_temps
from .data import dataset_fingerprint

# Config fields that may change between a checkpoint and its resume. The batch sizes count per
# process, so a resume on another number of processes may scale them to keep the global batch.
PORTABLE_FIELDS = {"num_train_epochs", "num_iterations", "logging_steps", "eval_interval", "eval_num_samples",
                   "verbose", "reward_model_device", "rollout_buffer_size", "train_batch_size",
                   "agent_devices", "critic_devices", "reference_devices"}
_CHECKPOINT_PREFIX = "checkpoint-"


def tokenizer_fingerprint(tokenizer) -> str:
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "padding_side": tokenizer.padding_side,
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(payload, default=str).encode()).hexdigest()


def module_fingerprint(module: torch.nn.Module) -> str:
    """Architecture identity: parameter names, shapes and dtypes (the weights come from the checkpoint)."""
    layout = [(name, list(t.shape), str(t.dtype)) for name, t in module.state_dict().items()]
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()


def checkpoint_sequence(path: Path) -> int | None:
    name = path.name
    if not name.startswith(_CHECKPOINT_PREFIX) or is_staging_name(name):
        return None
    digits = name[len(_CHECKPOINT_PREFIX):]
    return int(digits) if digits.isdigit() else None


def list_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Published ``checkpoint-N`` directories, oldest first (staging leftovers are skipped)."""
    if not checkpoint_dir.is_dir():
        return []
    found = [(checkpoint_sequence(p), p) for p in checkpoint_dir.iterdir() if p.is_dir()]
    return [p for seq, p in sorted((s, p) for s, p in found if s is not None)]


def check_loadable(path: str | Path) -> None:
    """Read every file a resume restores from a checkpoint (its metadata, each tensor, ``state.pt``),
    so one whose manifest was rewritten over damaged or foreign files is refused before anything is
    restored from it. Tensors are read one at a time, never the whole file at once."""
    path = Path(path)
    read_checkpoint_metadata(path)
    for file in sorted(path.rglob("*.safetensors")):
        check_tensors(file)
    load_state(path / "state.pt")


def latest_checkpoint(checkpoint_dir: str | Path) -> Path:
    """The newest checkpoint that verifies against its manifest and loads (older valid ones are skipped past)."""
    errors = []
    for path in reversed(list_checkpoints(Path(checkpoint_dir))):
        try:
            verify_dir(path)
            check_loadable(path)
            return path
        except CheckpointError as exc:
            errors.append(str(exc))
    detail = f" ({'; '.join(errors)})" if errors else ""
    raise CheckpointError(f"resume_from_checkpoint='latest': no valid checkpoint in {checkpoint_dir}{detail}.")


@dataclasses.dataclass
class Progress:
    """Where training stands: the next item to process, and counters that must survive a resume."""

    epoch: int = 0
    index: int = 0
    items_done: int = 0
    env_step: int = 0
    sequence: int = 0
    stage: str = "policy"  # preference trainers also pass through "collect" and "fit"
    iteration: int = 0


class CheckpointMixin:
    """``save_checkpoint``/``load_checkpoint`` for a trainer that provides ``_roles``, ``_optimizer_groups``,
    ``_runtime_state``/``_load_runtime_state``, ``tokenizers``, ``args``, ``progress`` and ``tracker``."""

    def _preflight(self, checkpoint_dir: Path) -> None:
        """Never overwrite another run's checkpoints; clear what killed writers left half-published."""
        if checkpoint_dir.is_dir():
            remove_stale_temps(checkpoint_dir)
        for path in list_checkpoints(checkpoint_dir):
            try:
                owner = read_checkpoint_metadata(path)["run_id"]
            except CheckpointError:
                owner = None
            if owner != self.run_id:
                raise FileExistsError(
                    f"checkpoint_dir {checkpoint_dir} already holds {path.name} of another run; resume it with "
                    "resume_from_checkpoint, or use an empty checkpoint_dir."
                )

    def _commit(self, checkpoint_dir: Path | None, save: bool, total_limit: int | None) -> None:
        self.progress.sequence += 1
        if checkpoint_dir is None or not save:
            return
        path = self.save_checkpoint(checkpoint_dir / f"{_CHECKPOINT_PREFIX}{self.progress.sequence}")
        if not self.dist.is_main:
            return
        if self._on_checkpoint is not None:
            self._on_checkpoint(path)
        if total_limit is not None:
            for old in list_checkpoints(checkpoint_dir)[:-total_limit]:
                shutil.rmtree(old)

    def _fingerprints(self) -> dict:
        return {
            "dataset": dataset_fingerprint(self.train_dataset),
            "tokenizers": [tokenizer_fingerprint(t) for t in self.tokenizers],
            "models": {role: [module_fingerprint(m) for m in modules] for role, modules in self._roles().items()},
            "callbacks": {name: f"{type(obj).__module__}.{type(obj).__qualname__}"
                          for name, obj in self._callbacks.items() if hasattr(obj, "state_dict")},
        }

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write the complete training state to ``path`` atomically (staging dir, fsync, rename).

        Every rank of a data-parallel job calls it; rank 0 writes, with each rank's buffers, and the
        others return once the checkpoint is published.
        """
        path = Path(path)
        runtime = self.dist.gather(self._runtime_state())

        def write(staging: Path) -> None:
            for role, modules in self._roles().items():
                if modules:
                    (staging / role).mkdir()
                for i, module in enumerate(modules):
                    save_tensors(staging / role / f"{i}.safetensors", module.state_dict())
            save_state(staging / "state.pt", {
                "optimizers": {group: [o.state_dict() for o in opts] for group, opts in self._optimizer_groups().items()},
                "rng": capture_rng(),
                "runtime": runtime,  # one state per rank
                "history": self.history,
                "eval_samples": self.eval_samples,
                "callbacks": {name: obj.state_dict() for name, obj in self._callbacks.items()
                              if hasattr(obj, "state_dict")},
            })
            write_metadata(staging, trainer_class=self.trainer_class(), sequence=self.progress.sequence,
                           run_id=self.run_id, wandb=self.tracker.identity(), extra={
                               "progress": dataclasses.asdict(self.progress),
                               "config": dataclasses.asdict(self.args),
                               "fingerprints": self._fingerprints(),
                           })

        if self.dist.is_main:
            publish_dir(path, write)
        self.dist.barrier()
        return path

    def load_checkpoint(self, path: str | Path) -> dict | None:
        """Verify, check compatibility, and restore everything; returns the W&B identity to resume."""
        path = Path(path)
        if path.name == METADATA:
            path = path.parent
        verify_dir(path)
        identity = read_checkpoint_metadata(path)
        meta = json.loads((path / METADATA).read_text())
        if identity["trainer_class"] != self.trainer_class():
            raise CheckpointError(f"{path} was written by {identity['trainer_class']}, not {self.trainer_class()}.")
        self._check_compatible(meta, path)
        for role, modules in self._roles().items():
            for i, module in enumerate(modules):
                module.load_state_dict(load_tensors(path / role / f"{i}.safetensors"))
        state = load_state(path / "state.pt")
        for group, opts in self._optimizer_groups().items():
            for opt, saved in zip(opts, state["optimizers"][group]):
                opt.load_state_dict(saved)
        for name, saved in state["callbacks"].items():
            self._callbacks[name].load_state_dict(saved)
        saved = state["runtime"]  # per rank; a different world size deals the saved ranks' buffers out
        saved = [saved] if isinstance(saved, dict) else saved  # written before data parallelism
        world, rank = self.dist.world_size, self.dist.rank
        self._load_runtime_state(saved[rank] if len(saved) == world
                                 else self._merge_runtime_states(saved, list(range(rank, len(saved), world))))
        self.tracker.history[:] = list(state["history"])
        self.eval_samples[:] = state.get("eval_samples", [])  # absent from checkpoints before it was kept
        self.progress = Progress(**meta["progress"])
        self.run_id = identity["run_id"]
        restore_rng(state["rng"])
        return identity["wandb"]

    def _check_compatible(self, meta: dict, path: Path) -> None:
        saved_config, config = meta["config"], json.loads(json.dumps(dataclasses.asdict(self.args)))
        fields = sorted(k for k in set(saved_config) | set(config)
                        if k not in PORTABLE_FIELDS and saved_config.get(k) != config.get(k))
        if fields:
            detail = ", ".join(f"{k}: checkpoint {saved_config.get(k)!r} != now {config.get(k)!r}" for k in fields)
            raise CheckpointError(f"{path}: the training config does not match the checkpoint ({detail}). Only "
                                  f"{sorted(PORTABLE_FIELDS)} may change on resume.")
        saved, now = meta["fingerprints"], self._fingerprints()
        mismatched = []
        if saved["dataset"] != now["dataset"]:
            mismatched.append("train_dataset (content or length differs)")
        for i, (a, b) in enumerate(zip(saved["tokenizers"], now["tokenizers"])):
            if a != b:
                mismatched.append(f"tokenizer {i} (vocabulary or special tokens differ)")
        for role, prints in now["models"].items():
            for i, (a, b) in enumerate(zip(saved["models"].get(role, []), prints)):
                if a != b:
                    mismatched.append(f"{role}[{i}] (architecture: parameter names, shapes or dtypes differ)")
            if len(saved["models"].get(role, [])) != len(prints):
                mismatched.append(f"{role} (count differs)")
        if saved["callbacks"] != now["callbacks"]:
            mismatched.append(f"stateful callbacks ({saved['callbacks']} != {now['callbacks']})")
        if mismatched:
            raise CheckpointError(f"{path} does not match this trainer: " + "; ".join(mismatched)
                                  + ". Recreate the trainer with the same models, tokenizers, data and callbacks.")
