"""Rows of token sequences as one model batch: right padding and de-duplication (what a model that
cannot run as a ``token_tree`` gets)."""

from __future__ import annotations

import torch


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
