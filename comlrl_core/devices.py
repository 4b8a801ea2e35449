"""Device settings, parsed and checked at construction, so an impossible placement fails before any work starts.

A device setting is ``None`` (the trainer's device), ``"auto"`` (entities spread round-robin over
the visible CUDA devices, the CPU when there is none), one device (``"cpu"``, ``"cuda:1"``: every
entity there) or, for per-entity settings, a list with one device per entity.
"""

from __future__ import annotations

import torch

AUTO = "auto"
_TYPES = ("cpu", "cuda", "mps")


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _field(argument: str) -> str:
    """``"MAGRPOConfig.agent_devices[1]"`` -> ``"agent_devices"``: the setting a user changes."""
    return argument.rsplit(".", 1)[-1].split("[", 1)[0]


def _parse(spec, argument: str) -> torch.device:
    """One device spec to a ``torch.device`` of a supported type; the machine is not consulted."""
    device = None
    if isinstance(spec, torch.device):
        device = spec
    elif isinstance(spec, str):
        try:
            device = torch.device(spec)
        except RuntimeError:
            pass
    if device is None or device.type not in _TYPES:
        raise ValueError(f"{argument}={spec!r} is not a device; use 'cpu', 'cuda', 'cuda:N' or 'mps' "
                         f"(or set {_field(argument)}='auto' or None).")
    return device


def _available(device: torch.device) -> tuple[bool, str]:
    if device.type == "cpu":
        return True, ""
    if device.type == "cuda":
        count = _cuda_count()
        if count == 0:
            return False, "CUDA is not available on this machine"
        if (device.index or 0) < count:
            return True, ""
        return False, f"this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
    ok = torch.backends.mps.is_available()
    return ok, "" if ok else "MPS is not available on this machine"


def _choices() -> str:
    return ", ".join(["'cpu'"] + [f"'cuda:{i}'" for i in range(_cuda_count())])


def check_device_spec(spec, argument: str) -> str | list[str] | None:
    """The machine-independent check of a device setting (for a config's ``__post_init__``).

    Returns its JSON form: ``None``, ``"auto"``, one device string, or a non-empty list of
    device strings (one per entity); ``torch.device`` values become strings. Whether the devices
    exist and the list length are checked by :func:`resolve_devices` when the trainer is built.
    """
    if spec is None or (isinstance(spec, str) and spec == AUTO):
        return spec
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ValueError(f"{argument}={spec!r} is empty; give one device per entity, one device for all "
                             "(e.g. 'cuda:1'), 'auto' or None.")
        return [str(_parse(item, f"{argument}[{i}]")) for i, item in enumerate(spec)]
    return str(_parse(spec, argument))


def resolve_device(spec: str | torch.device | None, argument: str) -> torch.device | None:
    """Parse and check one device spec; ``None`` stays ``None`` (the caller's default device).

    ``argument`` names the setting in the error, e.g. ``"MARLHFConfig.reward_model_device"``.
    A CUDA device without an index gets the current one, so equal placements compare equal.
    """
    if spec is None:
        return None
    device = _parse(spec, argument)
    ok, why = _available(device)
    if not ok:
        raise ValueError(
            f"{argument}={spec!r} is not available: {why}. Set {_field(argument)}=None (the trainer's device), "
            f"'auto', or a device this machine has: {_choices()}."
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def auto_devices(count: int, start: int = 0) -> list[torch.device]:
    """``count`` devices round-robin over the visible CUDA devices from ``cuda:start % n``; CPUs without CUDA."""
    n = _cuda_count()
    if n == 0:
        return [torch.device("cpu")] * count
    return [torch.device("cuda", (start + i) % n) for i in range(count)]


def resolve_devices(spec, count: int, argument: str, *, what: str = "agent",
                    default: torch.device | list | None = None, start: int = 0) -> list:
    """One checked device per entity (``count`` of them, each a ``what``) from a device setting.

    ``None`` gives ``default`` (one device for all, or a list of ``count``); ``"auto"`` gives
    :func:`auto_devices` from ``start``; one device is broadcast; a list must have ``count`` entries.
    """
    if spec is None:
        return list(default) if isinstance(default, list) else [default] * count
    if isinstance(spec, str) and spec == AUTO:
        return auto_devices(count, start)
    if isinstance(spec, (list, tuple)):
        if len(spec) != count:
            raise ValueError(
                f"{argument} has {len(spec)} entr{'y' if len(spec) == 1 else 'ies'} but there "
                f"{'is 1 ' + what if count == 1 else f'are {count} {what}s'}; give one device per {what}, one "
                f"device for all (e.g. {_field(argument)}='cuda:1'), 'auto' or None."
            )
        return [resolve_device(item, f"{argument}[{i}]") for i, item in enumerate(spec)]
    return [resolve_device(spec, argument)] * count


def resolve_one(spec, argument: str, *, start: int = 0) -> torch.device | None:
    """A single-entity setting (e.g. the reward model): ``None``, ``"auto"`` (the ``start``-th device
    round-robin) or one device; a list is refused."""
    if isinstance(spec, str) and spec == AUTO:
        return auto_devices(1, start)[0]
    return resolve_device(spec, argument)


def default_device() -> torch.device:
    """The first CUDA device when present, else the CPU."""
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
