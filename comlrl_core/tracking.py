"""Metrics: one small logger for stdout and Weights & Biases, and the W&B run identity rules.

The run opens lazily, when training starts, so resuming from a checkpoint never opens an empty
run first. Every log call carries an explicit step, so a resumed run continues its step counter.
Offline and disabled modes (``WANDB_MODE`` or ``wandb_config["mode"]``) need no network.
"""

from __future__ import annotations

import math
from pathlib import Path

_INIT_KEYS = {"project", "entity", "name", "run_name", "dir", "tags", "id", "resume", "mode", "group",
              "notes", "job_type", "config_sections"}


def check_wandb_config(wandb_config: dict | None) -> dict | None:
    """Validate keys at construction; an unknown key is a typo, not something to drop silently."""
    if wandb_config is None:
        return None
    if not isinstance(wandb_config, dict):
        raise TypeError(f"wandb_config must be a dict or None, got {type(wandb_config).__name__}.")
    unknown = sorted(set(wandb_config) - _INIT_KEYS)
    if unknown:
        raise ValueError(f"wandb_config has unknown keys {unknown}; known keys: {sorted(_INIT_KEYS)}.")
    return dict(wandb_config)


def merge_identity(wandb_config: dict, identity: dict | None) -> dict:
    """The checkpoint's run identity, unless the caller set ``id`` or ``resume`` explicitly."""
    if identity and "id" not in wandb_config and "resume" not in wandb_config:
        return {**wandb_config, **identity, "resume": "allow"}
    return wandb_config


class Tracker:
    """Prints metrics when verbose and logs them to W&B when configured; keeps a history for callers."""

    def __init__(self, wandb_config: dict | None, run_config: dict, verbose: bool):
        self.wandb_config = wandb_config
        self.run_config = run_config
        self.verbose = verbose
        self.run = None
        self._owned = False
        self.history: list[dict] = []

    def start(self, identity: dict | None = None) -> None:
        if self.wandb_config is None or self.run is not None:
            return
        import wandb

        cfg = merge_identity(self.wandb_config, identity)
        config = dict(self.run_config)
        for section in (cfg.get("config_sections") or {}).values():
            config.update(section if isinstance(section, dict) else {})
        kwargs = {k: cfg[k] for k in ("project", "entity", "tags", "id", "resume", "mode", "group", "notes",
                                       "job_type") if cfg.get(k) is not None}
        if cfg.get("name") or cfg.get("run_name"):
            kwargs["name"] = cfg.get("name") or cfg.get("run_name")
        if cfg.get("dir"):
            Path(cfg["dir"]).mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(cfg["dir"])
        self.run = wandb.init(config=config, **kwargs)
        self._owned = True

    def identity(self) -> dict | None:
        if self.run is None:
            return None
        ident = {"id": self.run.id}
        for key in ("project", "entity"):
            value = getattr(self.run, key, None)
            if isinstance(value, str) and value:
                ident[key] = value
        return ident

    def log(self, metrics: dict, step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if not clean:
            return
        self.history.append({"step": step, **clean})
        if self.run is not None:
            self.run.log(clean, step=step)
        if self.verbose:
            print(f"[step {step}] " + "  ".join(f"{k}={v:.4g}" for k, v in sorted(clean.items())), flush=True)

    def finish(self) -> None:
        """Finish the run this tracker opened; a run the caller owns is left alone."""
        if self.run is not None and self._owned:
            self.run.finish()
        self.run = None
        self._owned = False
