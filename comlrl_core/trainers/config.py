"""Validation helpers shared by every trainer config's ``__post_init__``.

Each check raises a ``ValueError`` that names the config class and field, so a bad value fails at
construction, before any model loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..devices import check_device_spec


def _name(config, field: str) -> str:
    return f"{type(config).__name__}.{field}"


def check_int(config, field: str, minimum: int, *, optional: bool = False) -> None:
    value = getattr(config, field)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = " or None" if optional else ""
        raise ValueError(f"{_name(config, field)} must be an integer >= {minimum}{extra}, got {value!r}.")


def check_float(config, field: str, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, optional: bool = False) -> None:
    value = getattr(config, field)
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        bounds = []
        if low is not None:
            bounds.append(f"{'>' if low_open else '>='} {low}")
        if high is not None:
            bounds.append(f"<= {high}")
        extra = " or None" if optional else ""
        raise ValueError(f"{_name(config, field)} must be a finite number {' and '.join(bounds)}{extra}, got {value!r}.")


def check_choice(config, field: str, aliases: dict[str, str]) -> None:
    """Normalise a case-insensitive choice (with aliases) in place."""
    value = getattr(config, field)
    key = value.lower() if isinstance(value, str) else None  # a list or dict must fail here, not as unhashable
    if key not in aliases:
        raise ValueError(f"{_name(config, field)} must be one of {sorted(set(aliases.values()))}, got {value!r}.")
    setattr(config, field, aliases[key])


def check_devices(config, field: str) -> None:
    """Check a device setting's form (not the machine) and store its JSON form (``torch.device`` -> str)."""
    setattr(config, field, check_device_spec(getattr(config, field), _name(config, field)))


def check_bool(config, field: str) -> None:
    if not isinstance(getattr(config, field), bool):
        raise ValueError(f"{_name(config, field)} must be True or False, got {getattr(config, field)!r}.")


@dataclass
class TrainerConfig:
    """Fields every RL trainer shares (sampling, data order, buffers, logging), validated once here.

    Subclasses redeclare a field to change its default and extend ``__post_init__``.
    ``num_agents=None`` means "as the trainer resolves it"; ``seed``/``shuffle`` make the data
    order random but reproducible (the reference never shuffled and had no seed).

    ``agent_devices``/``reference_devices`` place the agents and their KL reference models: None
    (the trainer's device; references follow their agent), ``"auto"`` (agent i on ``cuda:i % n``,
    the CPU without CUDA), one device for all, or a list with one device per agent. Whether the
    devices exist and the list lengths are checked when the trainer is built, before any weights load.
    """

    num_train_epochs: int = 20
    agent_learning_rate: float = 5e-6
    num_agents: int | None = None
    num_generations: int = 4
    max_new_tokens: int = 256
    temperature: float = 0.6
    top_p: float = 0.6
    top_k: int | None = None
    num_turns: int = 1
    discount: float = 1.0
    early_termination_threshold: float | None = None
    external_prompt_passthrough: bool = False
    rollout_buffer_size: int = 2
    train_batch_size: int | None = None
    advantage_normalization: bool = True
    reference_kl_enabled: bool = False
    reference_kl_coef: float = 0.1
    agent_devices: str | list[str] | None = None
    reference_devices: str | list[str] | None = None
    max_grad_norm: float | None = None
    eval_interval: int = 16
    eval_num_samples: int = 4
    logging_steps: int = 1
    seed: int = 0
    shuffle: bool = True
    allow_shared_models: bool = False
    verbose: bool = True

    min_generations = 1  # class attribute, not a field: the group baseline needs 2 in MAGRPO

    def __post_init__(self) -> None:
        check_int(self, "num_train_epochs", 1)
        check_float(self, "agent_learning_rate", low=0.0, low_open=True)
        check_int(self, "num_agents", 1, optional=True)
        check_int(self, "num_generations", self.min_generations)
        check_int(self, "max_new_tokens", 1)
        check_float(self, "temperature", low=0.0, low_open=True)
        check_float(self, "top_p", low=0.0, high=1.0, low_open=True)
        check_int(self, "top_k", 1, optional=True)
        check_int(self, "num_turns", 1)
        check_float(self, "discount", low=0.0, high=1.0)
        check_float(self, "early_termination_threshold", optional=True)
        check_int(self, "rollout_buffer_size", 1)
        if self.train_batch_size is None:
            self.train_batch_size = self.rollout_buffer_size
        check_int(self, "train_batch_size", 1)
        check_float(self, "reference_kl_coef", low=0.0)
        check_float(self, "max_grad_norm", low=0.0, low_open=True, optional=True)
        check_int(self, "eval_interval", 0)
        check_int(self, "eval_num_samples", 0)
        check_int(self, "logging_steps", 1)
        check_int(self, "seed", 0)
        check_devices(self, "agent_devices")
        check_devices(self, "reference_devices")
        for field in ("external_prompt_passthrough", "advantage_normalization", "reference_kl_enabled",
                      "shuffle", "allow_shared_models", "verbose"):
            check_bool(self, field)
