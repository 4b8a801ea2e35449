"""Rows of token sequences as model batches: right padding, de-duplication, and common prefixes run once.

Rows that begin with the same tokens (a sample's K completions behind one prompt, a winner and its
loser behind one joint prompt) can put those tokens through the model once, into a KV cache that is
dealt out to the rows, and then run only their own tails on it: the arithmetic of the full rows
without the repeated tokens (equal within float rounding, tested).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

SHARING_ARCHITECTURES = {"llama", "qwen2", "mistral"}  # decoders whose forward on a cache is tested equal
# A prefix pass costs one more trip over the weights (read, weight gradient, its accumulation), so
# it runs only from this many tokens saved. CPU: the crossover measured with the 10M benchmark model;
# CUDA: with a 0.36B bf16 model on an H200, where an update pass is kernel launches until it holds
# tens of thousands of tokens (shared ÷ full rows 1.38-1.98 at 7.9K tokens saved, 0.60 at 31.7K;
# see the README). Other accelerators are taken to be like CUDA.
PAYS_FROM = {"cpu": 32, "cuda": 16384}
PAYS_FROM_ELSEWHERE = 16384


def distinct(sequences: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The distinct sequences in first-seen order, and each input's index among them [B]."""
    first: dict[tuple, int] = {}
    index = [first.setdefault(tuple(s.tolist()), len(first)) for s in sequences]
    return [torch.tensor(key, dtype=sequences[0].dtype) for key in first], torch.tensor(index)


def right_pad(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of any lengths as one zero-padded [B, L] batch (their dtype) and its 0/1 presence mask."""
    length = max(s.shape[0] for s in sequences)
    padded = torch.zeros(len(sequences), length, dtype=sequences[0].dtype)
    present = torch.zeros(len(sequences), length, dtype=torch.long)
    for b, s in enumerate(sequences):
        padded[b, :s.shape[0]], present[b, :s.shape[0]] = s, 1
    return padded, present


def cache_keyword(model: nn.Module, length: int) -> str | None:
    """The forward's cache argument (``cache`` in newer transformers, ``past_key_values`` before), or
    None where running a prefix once and the tails on its cache is not known to equal the full
    forward of ``length`` tokens: other architectures, sliding windows shorter than that, gradient
    checkpointing (which turns the cache off)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in SHARING_ARCHITECTURES:
        return None
    if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        return None
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return None
    window = getattr(config, "sliding_window", None)
    if window is not None and length > window:
        return None
    return _cache_parameter(type(model))


@functools.cache
def _cache_parameter(model_class: type) -> str | None:
    """The forward's cache argument of a model class (a signature is read once per class: ~0.1 ms)."""
    parameters = inspect.signature(model_class.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


@dataclass
class SharedPrefixes:
    """Rows grouped behind common prefixes: each group's prefix (at least one token) and each row's group."""

    prefixes: list[torch.Tensor]
    groups: torch.Tensor  # [B]
    saved: int  # tokens the rows no longer run
    keyword: str  # the model's cache argument

    @property
    def lengths(self) -> list[int]:
        """Each row's prefix length: its tail starts there."""
        return [len(self.prefixes[g]) for g in self.groups.tolist()]


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _group(sequences: list[torch.Tensor], limits: list[int]) -> tuple[list[torch.Tensor], torch.Tensor, int] | None:
    """Groups saving the most tokens: in sorted order, a contiguous run of g rows shares its common
    prefix (capped by the rows' ``limits``) and saves (g-1) times its length; the best split into
    runs is a small dynamic programme. A row left alone hands the cache as much of itself as the
    longest shared prefix, so the tails stay short. None when nothing is saved or a row has no prefix."""
    tokens = [s.tolist() for s in sequences]
    order = sorted(range(len(tokens)), key=tokens.__getitem__)
    adjacent = [_lcp(tokens[a], tokens[b]) for a, b in zip(order, order[1:])]
    best, start, common = [0] * (len(order) + 1), [0] * (len(order) + 1), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):  # rows order[begin:end] as one run
        best[end], start[end], shared = best[end - 1], end - 1, limits[order[end - 1]]
        for begin in range(end - 2, -1, -1):
            shared = min(shared, adjacent[begin], limits[order[begin]])
            if shared == 0:
                break
            if best[begin] + (end - 1 - begin) * shared > best[end]:
                best[end], start[end], common[end] = best[begin] + (end - 1 - begin) * shared, begin, shared
    runs, end = [], len(order)
    while end:
        runs.append((start[end], end, common[end] if end - start[end] > 1 else None))
        end = start[end]
    longest = max((c for _, _, c in runs if c is not None), default=0)
    if longest == 0:
        return None
    cut = [0] * len(tokens)
    for begin, end, shared in runs:
        for row in order[begin:end]:
            cut[row] = shared if shared is not None else min(limits[row], longest)
    if min(cut) == 0:
        return None
    prefixes, groups = distinct([s[:n] for s, n in zip(sequences, cut)])
    return prefixes, groups, best[-1]


def share_prefixes(model: nn.Module, sequences: list[torch.Tensor], limits: list[int],
                   length: int) -> SharedPrefixes | None:
    """How ``model`` can run ``sequences`` (row b handing at most ``limits[b]`` leading tokens to the
    cache; rows at most ``length`` tokens long) with their common prefixes once, or None where that
    does not save enough tokens to pay for the prefix pass or is not known to be exact."""
    keyword = cache_keyword(model, length)
    if keyword is None:
        return None
    grouped = _group(sequences, limits)
    device = next(model.parameters()).device
    if grouped is None or grouped[2] < PAYS_FROM.get(device.type, PAYS_FROM_ELSEWHERE):
        return None
    return SharedPrefixes(*grouped, keyword=keyword)


def forward_on_prefixes(model: nn.Module, shared: SharedPrefixes, tail_ids: torch.Tensor, tail_present: torch.Tensor,
                        run=None, **prefix_kwargs):
    """``model``'s output for the rows' right-padded tails [B, T] (0/1 ``tail_present``), each read
    after its group's prefix: the distinct prefixes fill one cache (with gradients outside
    ``inference_mode``), which is indexed out to the rows, and the tails run on it at their own
    positions. ``prefix_kwargs`` go to the prefix pass only (``logits_to_keep=1`` for a causal LM);
    ``run`` (default: ``model`` itself) is called with the forward's arguments for both passes, and
    what it returns for the tails is returned."""
    run = run or model
    device = next(model.parameters()).device
    prefix_ids, prefix_mask = right_pad(shared.prefixes)
    groups = shared.groups
    cache = DynamicCache(config=model.config)
    run(input_ids=prefix_ids.to(device), attention_mask=prefix_mask.to(device), use_cache=True,
        **{shared.keyword: cache}, **prefix_kwargs)
    cache.batch_select_indices(groups.to(device))
    mask = torch.cat([prefix_mask[groups], tail_present], dim=1)
    positions = prefix_mask.sum(dim=1)[groups][:, None] + torch.arange(tail_ids.shape[1])
    return run(input_ids=tail_ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
               use_cache=True, **{shared.keyword: cache})
