"""Device specs checked at construction, so a missing device fails before any work starts."""

from __future__ import annotations

import torch


def _available(device: torch.device) -> tuple[bool, str]:
    if device.type == "cpu":
        return True, ""
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index or 0
        if index < count:
            return True, ""
        return False, f"this machine has {count} CUDA device(s)"
    if device.type == "mps":
        ok = torch.backends.mps.is_available()
        return ok, "" if ok else "MPS is not available on this machine"
    return False, f"device type {device.type!r} is not supported"


def resolve_device(spec: str | torch.device | None, argument: str) -> torch.device | None:
    """Parse and check one device spec; ``None`` stays ``None`` (the caller's default device).

    ``argument`` names the setting in the error, e.g. ``"MARLHFConfig.reward_model_device"``.
    """
    if spec is None:
        return None
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{argument}={spec!r} is not a device; use 'cpu', 'cuda:N' or None.") from exc
    ok, why = _available(device)
    if not ok:
        raise ValueError(
            f"{argument}={spec!r} is not available: {why}. Pass {argument.rsplit('.', 1)[-1]}=None "
            "to use the trainer's device, or 'cpu'."
        )
    return device


def default_device() -> torch.device:
    """The first CUDA device when present, else the CPU."""
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
