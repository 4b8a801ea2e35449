"""Datasets, formatters and multi-turn transitions: how dataset items become per-agent prompts."""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Iterable, Iterator

import torch

from ..prompts import PromptTemplate


def is_map_style(dataset: object) -> bool:
    return hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")


def check_dataset(dataset: object, argument: str) -> None:
    """A dataset is a sequence of dicts (list, ``datasets.Dataset``) or an iterable of dicts."""
    if dataset is None:
        return
    if isinstance(dataset, (str, bytes, dict)) or not (is_map_style(dataset) or isinstance(dataset, Iterable)):
        raise TypeError(f"{argument} must be a list of dicts, a datasets.Dataset or an iterable of dicts; "
                        f"got {type(dataset).__name__}.")
    if is_map_style(dataset):
        if len(dataset) == 0:
            raise ValueError(f"{argument} is empty.")
        # An in-memory list is checked whole (cheap); other datasets by their first row, without reading them all.
        rows = dataset if isinstance(dataset, (list, tuple)) else [dataset[0]]
        for i, item in enumerate(rows):
            if not isinstance(item, dict):
                raise TypeError(f"{argument}[{i}] must be a dict (e.g. {{'prompt': ...}}), got {type(item).__name__}.")


def epoch_items(dataset: object, epoch: int, seed: int, shuffle: bool, start: int) -> Iterator[tuple[int, dict]]:
    """``(index, item)`` for one epoch from position ``start``.

    The order is a pure function of ``(seed, epoch)``, so a resumed run replays it exactly.
    Iterable datasets are read in their own order (a ``state_dict``-capable one restores itself).
    """
    if is_map_style(dataset):
        order = range(len(dataset))
        if shuffle:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            order = torch.randperm(len(dataset), generator=generator).tolist()
        for index in range(start, len(order)):
            yield index, _as_item(dataset[order[index]], index)
        return
    for index, item in enumerate(dataset):
        if index >= start:
            yield index, _as_item(item, index)


def _as_item(item: object, index: int) -> dict:
    if not isinstance(item, dict):
        raise TypeError(f"train_dataset item {index} must be a dict, got {type(item).__name__}.")
    return item


def dataset_fingerprint(dataset: object) -> dict:
    """Identity of a dataset for resume checks: HF fingerprint, content hash of a list, or class and length."""
    if dataset is None:
        return {"class": None}
    info = {"class": f"{type(dataset).__module__}.{type(dataset).__qualname__}"}
    if hasattr(dataset, "_fingerprint"):
        info["fingerprint"] = str(dataset._fingerprint)
    elif isinstance(dataset, (list, tuple)):
        payload = json.dumps(list(dataset), sort_keys=True, default=repr).encode()
        info["fingerprint"] = hashlib.sha256(payload).hexdigest()
    if is_map_style(dataset):
        info["length"] = len(dataset)
    return info


def _declares(func: Callable, name: str) -> bool:
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class Formatter:
    """``item -> prompt`` for one agent: a callable (``external_prompts`` is passed only when it
    declares it), a :class:`~comlrl_core.prompts.PromptTemplate` rendered with the agent's tokenizer,
    or None for ``item["prompt"]``."""

    def __init__(self, func: Callable | PromptTemplate | None, index: int, tokenizer=None):
        if func is not None and not callable(func) and not isinstance(func, PromptTemplate):
            raise TypeError(f"formatters[{index}] must be callable or a PromptTemplate, got {type(func).__name__}.")
        self.func = func
        self.index = index
        self.tokenizer = tokenizer
        self.takes_external = callable(func) and _declares(func, "external_prompts")

    def check(self, item: dict, dataset: str) -> None:
        """A template's fields and chat template, or the default's ``prompt`` field, checked on a first
        item before any weights load (a Python formatter is the user's own code: not called here)."""
        if isinstance(self.func, PromptTemplate):
            self.func.check(item, self.tokenizer, f"formatters[{self.index}] ({dataset})")
        elif self.func is None and not (isinstance(item.get("prompt"), str) and item["prompt"]):
            raise ValueError(f"{dataset}: its first item has no non-empty 'prompt' field (it has "
                             f"{sorted(item)}); give prompt_templates or formatters that build the prompt from "
                             "its fields.")

    def __call__(self, item: dict, external_prompt: str | None = None) -> str:
        if self.func is None:
            prompt = external_prompt if external_prompt is not None else item.get("prompt")
        elif isinstance(self.func, PromptTemplate):
            prompt = self.func.render(item, self.tokenizer, external_prompt)
        elif external_prompt is not None and self.takes_external:
            prompt = self.func(item, external_prompts=external_prompt)
        else:
            prompt = self.func(item)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"formatter {self.index} returned {prompt!r}; it must return a non-empty string "
                             "(the default formatter reads item['prompt']).")
        return prompt


def build_formatters(formatters: object, num_agents: int, tokenizers: list | None = None) -> list[Formatter]:
    """None (use ``item['prompt']``), one callable or template for every agent, or one per agent;
    templates render with agent i's tokenizer (its chat template)."""
    tokenizers = tokenizers or [None] * num_agents
    if formatters is None or callable(formatters) or isinstance(formatters, PromptTemplate):
        return [Formatter(formatters, i, tokenizers[i]) for i in range(num_agents)]
    if isinstance(formatters, (list, tuple)):
        if len(formatters) != num_agents:
            raise ValueError(f"formatters has {len(formatters)} entries but there are {num_agents} agents; "
                             "give one formatter per agent or a single callable.")
        return [Formatter(f, i, tokenizers[i]) for i, f in enumerate(formatters)]
    raise TypeError(f"formatters must be None, a callable, a PromptTemplate or a list of them, "
                    f"got {type(formatters).__name__}.")


def check_formatters(formatters: list[Formatter], train_dataset: object, eval_dataset: object) -> None:
    """Every template's fields and chat template, against each dataset's first item (an iterable
    dataset is not consumed to peek at it): what must fail before any weights load."""
    for dataset, name in ((train_dataset, "train_dataset"), (eval_dataset, "eval_dataset")):
        if dataset is not None and is_map_style(dataset) and isinstance(item := dataset[0], dict):
            for formatter in formatters:
                formatter.check(item, name)


def next_prompts(transition: Callable, item: dict, completions: list[str], prompt_history: list[list[str]],
                 response_history: list[list[str]], formatters: list[Formatter], passthrough: bool) -> list[str]:
    """The next turn's per-agent prompts from ``external_transition``."""
    num_agents = len(completions)
    result = transition(prompt=item.get("prompt", ""), agent_completions=list(completions), num_agents=num_agents,
                        prompt_history_per_agent=prompt_history, response_history_per_agent=response_history)
    if not isinstance(result, (list, tuple)) or len(result) != num_agents or not all(isinstance(p, str) for p in result):
        raise ValueError(f"external_transition must return a list of {num_agents} prompt strings (one per agent), "
                         f"got {result!r}.")
    if passthrough:
        return list(result)
    return [formatters[i]({**item, "prompt": p}, external_prompt=p) for i, p in enumerate(result)]
