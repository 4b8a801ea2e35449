"""Saving tensors and training state without ever unpickling arbitrary objects.

Weights go through safetensors; everything else (optimizer states, step counters, RNG states) is
restricted to plain containers, numbers, strings and tensors, so it can be loaded with
``torch.load(weights_only=True)`` and a checkpoint from elsewhere cannot run code on load.
"""

from __future__ import annotations

import pickle
import random
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .atomic import CheckpointError

_ATOMS = (str, int, float, bool, type(None))
_MAPPINGS = (dict, OrderedDict)
_SEQUENCES = (list, tuple)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` as a safetensors file, dtypes unchanged.

    safetensors refuses tensors that share storage (tied weights), so a tensor whose storage was
    already seen is saved as its own contiguous copy; the caller's tensors are not modified.
    """
    seen: set[int] = set()
    plain = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"save_tensors({path}): entry {name!r} must map a str to a torch.Tensor.")
        tensor = tensor.detach().cpu()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen.add(storage)
        plain[name] = tensor
    save_file(plain, str(path), metadata={"format": "pt"})


def load_tensors(path: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file written by :func:`save_tensors` onto ``device``."""
    try:
        return load_file(str(path), device=str(device))
    except SafetensorError as exc:
        raise _unreadable(path, exc) from None


def check_tensors(path: str | Path) -> None:
    """Read every tensor of a safetensors file, one at a time, refusing a damaged file by name."""
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                f.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise _unreadable(path, exc) from None


def _unreadable(path, exc: Exception) -> CheckpointError:
    return CheckpointError(f"{path} is not a readable safetensors file ({exc}): it is corrupted or truncated.")


def save_state(path: str | Path, tree) -> None:
    """``torch.save`` a tree of plain containers, numbers, strings and tensors.

    The tree is checked first so that anything :func:`load_state` would refuse fails now, at save
    time, with the key path of the offending value.
    """
    _check_tree(tree, "state")
    torch.save(tree, str(path))


def load_state(path: str | Path):
    """Load a tree written by :func:`save_state`; anything but tensors and plain values is refused."""
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise CheckpointError(
            f"{path} could not be loaded as plain training state ({type(exc).__name__}): it is corrupted, "
            "or it holds objects other than tensors, containers and numbers, which are never unpickled."
        ) from None


def capture_rng() -> dict:
    """Snapshot of every global random generator training draws from, in a form :func:`save_state` accepts."""
    version, internal, gauss_next = random.getstate()
    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = list(torch.cuda.get_rng_state_all())
    return {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "algorithm": algorithm,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def restore_rng(state: dict) -> None:
    """Put every generator back exactly as :func:`capture_rng` found it, so resumed draws match."""
    missing = sorted({"python", "numpy", "torch", "cuda"} - state.keys())
    if missing:
        raise CheckpointError(f"RNG state is missing {missing}: it was not produced by capture_rng().")
    cuda = state["cuda"]
    if cuda is not None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(cuda) != count:
            raise CheckpointError(
                f"RNG state holds {len(cuda)} CUDA generator(s) but this machine has {count} CUDA device(s); "
                "resume with the same number of visible GPUs (CUDA_VISIBLE_DEVICES) to reproduce the run."
            )
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    nps = state["numpy"]
    keys = nps["keys"].numpy().astype(np.uint32)
    np.random.set_state((nps["algorithm"], keys, nps["pos"], nps["has_gauss"], nps["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _check_tree(value, where: str) -> None:
    """Raise TypeError naming the key path of the first value ``weights_only`` loading would reject."""
    kind = type(value)
    if kind in _ATOMS or kind in _TENSORS:
        return
    if kind in _MAPPINGS:
        for key, item in value.items():
            if type(key) not in _ATOMS:
                raise TypeError(f"{where}: key {key!r} of type {_type_name(key)} is not allowed; use str or int keys.")
            _check_tree(item, f"{where}[{key!r}]")
    elif kind in _SEQUENCES:
        for index, item in enumerate(value):
            _check_tree(item, f"{where}[{index}]")
    else:
        raise TypeError(
            f"{where}: {_type_name(value)} is not allowed in saved state; convert it to a torch.Tensor, "
            "a plain number/str, or a dict/list/tuple of those."
        )


def _type_name(value) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
