"""Model sources (hub ids, local directories, loaded models) and the seed's consistency rules.

Nothing here loads weights: rules are checked on the arguments, names and configs alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Union

from torch import nn
from transformers import AutoConfig, PreTrainedModel

from ..models import CausalLMWithValueHead

Source = Union[str, os.PathLike, PreTrainedModel, CausalLMWithValueHead]

_MODEL_TYPES = (PreTrainedModel, CausalLMWithValueHead)


def is_model_object(source: object) -> bool:
    return isinstance(source, _MODEL_TYPES)


def _looks_like_path(text: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else that is path-shaped must exist locally."""
    return text.startswith(("/", ".", "~")) or text.count("/") >= 2 or os.path.exists(text)


def local_dir(source: str, label: str) -> Path | None:
    """The directory a path-shaped source names (None for a hub id); a missing one fails naming ``label``."""
    if not source.strip():
        raise ValueError(f"{label} is an empty string; pass a Hugging Face model id or a local directory.")
    if not _looks_like_path(source):
        return None
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ValueError(f"{label}={source!r}: local directory does not exist; check the path.")
    return path


def check_source(source: object, label: str) -> Source:
    """A usable source, or a clear error: ids are strings, directories exist and hold a config.json."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, str):
        path = local_dir(source, label)
        if path is not None and not (path / "config.json").is_file():
            raise ValueError(
                f"{label}={source!r}: directory has no config.json, so it is not a saved Hugging Face model "
                "(save one with model.save_pretrained(dir))."
            )
        return source
    if is_model_object(source):
        return source
    raise TypeError(
        f"{label} must be a Hugging Face model id, a local model directory or a loaded PreTrainedModel; "
        f"got {type(source).__name__}."
    )


def source_name(source: Source) -> str | None:
    """The loadable name of a source: the id/dir itself, or a loaded model's ``name_or_path``.

    A model built from a config (never saved or loaded) has no loadable name and gives ``None``;
    unlike the reference we never fall back to ``model_type``, which ``from_pretrained`` cannot load.
    """
    if isinstance(source, str):
        return source
    model = source.model if isinstance(source, CausalLMWithValueHead) else source
    name = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    return name or None


def same_name(a: str, b: str) -> bool:
    """Local directories compare by resolved path, hub ids by string."""
    if os.path.isdir(os.path.expanduser(a)) and os.path.isdir(os.path.expanduser(b)):
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    return a == b


def _as_list(value: object, kind: str) -> list:
    if isinstance(value, (str, bytes, os.PathLike)) or is_model_object(value) or not isinstance(value, Sequence):
        raise TypeError(f"{kind} must be a list (one entry per model); got {type(value).__name__}.")
    if len(value) == 0:
        raise ValueError(f"{kind} is an empty list; give one entry per model or leave it None.")
    return list(value)


def resolve_count(claims: list[tuple[str, int | None]], default: int, *, owner: str) -> int:
    """The number of agents: every given claim must agree, else an error naming each one."""
    given = [(label, value) for label, value in claims if value is not None]
    for label, value in given:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {label} must be a positive integer, got {value!r}.")
    values = {value for _, value in given}
    if len(values) > 1:
        listed = ", ".join(f"{label}={value}" for label, value in given)
        raise ValueError(
            f"{owner}: the number of agents is inconsistent ({listed}). Set them to the same value; "
            "a config's num_agents alone never overrides the constructor."
        )
    return values.pop() if values else default


def resolve_sources(kind: str, model: object, models: object, count: int, *, model_label: str, what: str) -> list[Source]:
    """One source per role from a homogeneous shortcut (``model``) and/or a list (``models``).

    ``kind``/``model_label`` name the list and shortcut arguments (``agents``/``agent_model``),
    ``what`` names the count (``"agents"``, ``"critic (MAAC has one)"``).
    """
    if model is None and models is None:
        raise ValueError(f"Either {model_label} or {kind} must be provided.")
    if models is not None:
        entries = _as_list(models, kind)
        if len(entries) != count:
            raise ValueError(f"{kind} has {len(entries)} entries but there are {count} {what}; give one entry each.")
        sources = [check_source(entry, f"{kind}[{i}]") for i, entry in enumerate(entries)]
        if model is not None:
            shortcut = check_source(model, model_label)
            expected = source_name(shortcut)
            names = [source_name(s) for s in sources]
            if expected is None or None in names:
                raise ValueError(
                    f"Cannot check that {model_label} and {kind} agree: a loaded model has no name "
                    f"(model.name_or_path is empty). Give only {kind}, or only {model_label}."
                )
            if not all(same_name(expected, name) for name in names):
                raise ValueError(
                    f"{model_label} and {kind} conflict: {expected!r} != {names}. They must name the same "
                    f"model; for different models give only {kind}."
                )
        return sources
    return [check_source(model, model_label)] * count


def check_distinct_objects(groups: list[tuple[str, list[Source]]], allow_shared: bool, *, owner: str) -> None:
    """A loaded model object used for two roles shares its weights across optimizers: refuse unless opted in."""
    if allow_shared:
        return
    seen: dict[int, str] = {}
    for label, sources in groups:
        for i, source in enumerate(sources):
            if not is_model_object(source):
                continue
            where = f"{label}[{i}]"
            if id(source) in seen:
                raise ValueError(
                    f"{owner}: {seen[id(source)]} and {where} are the same model object, so they would share "
                    "weights across optimizers. Pass separate models (or ids/directories, loaded once per role), "
                    "or set allow_shared_models=True in the config to share on purpose."
                )
            seen[id(source)] = where


def vocab_size(source: Source, trust_remote_code: bool = False) -> int:
    """Rows of the input embedding: from the config for ids/dirs (no weights), from the module for objects.

    ``trust_remote_code`` is always passed: left unset, transformers would ask on stdin whether to run
    the model's code instead of refusing it.
    """
    if isinstance(source, str):
        try:
            config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        except ValueError as exc:
            if trust_remote_code or "trust_remote_code" not in str(exc):
                raise
            raise ValueError(
                f"{source!r} ships its own Python code (auto_map in its config.json), which is never run unless you "
                "opt in: set model_config['trust_remote_code']=True (model_options in a run spec) only if you "
                "trust that code."
            ) from None
        return int(config.get_text_config().vocab_size)
    model = source.model if isinstance(source, CausalLMWithValueHead) else source
    embeddings = model.get_input_embeddings()
    if not isinstance(embeddings, nn.Embedding):
        return int(model.config.get_text_config().vocab_size)
    return int(embeddings.num_embeddings)
