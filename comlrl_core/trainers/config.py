"""Validation helpers shared by every trainer config's ``__post_init__``.

Each check raises a ``ValueError`` that names the config class and field, so a bad value fails at
construction, before any model loads.
"""

from __future__ import annotations

import math


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
    key = value.lower() if isinstance(value, str) else value
    if key not in aliases:
        raise ValueError(f"{_name(config, field)} must be one of {sorted(set(aliases.values()))}, got {value!r}.")
    setattr(config, field, aliases[key])


def check_bool(config, field: str) -> None:
    if not isinstance(getattr(config, field), bool):
        raise ValueError(f"{_name(config, field)} must be True or False, got {getattr(config, field)!r}.")
