"""What the heads need from a Hugging Face causal LM: its width and its last hidden states."""

from __future__ import annotations

import torch
from torch import nn

from .. import token_tree
from ..batching import distinct, right_pad


def hidden_size(model: nn.Module) -> int:
    """Width of the backbone's last hidden state (``hidden_size``, ``n_embd`` or ``d_model``)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no `config`; pass a Hugging Face PreTrainedModel.")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(
        f"Unsupported backbone {type(model).__name__}: its config has no `hidden_size`, `n_embd` or `d_model`."
    )


def last_hidden_state(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Final-layer hidden states [B, L, H] without computing the LM head's logits.

    The transformer body (``model.base_model``) applies the final norm, so this equals
    ``model(..., output_hidden_states=True).hidden_states[-1]`` at a fraction of the cost.
    """
    body = model.base_model
    if body is model:  # no separate body: fall back to the full forward
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        return out.hidden_states[-1]
    return body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def last_token_scores(model: nn.Module, head: nn.Module, sequences: list[torch.Tensor]) -> torch.Tensor:
    """A scalar ``head``'s output [B] at each token sequence's last token, as the sequence alone gives
    it (within float rounding); identical sequences run once and score identically. A Llama-style
    decoder runs the distinct sequences as one prefix tree (``token_tree``: common prefixes once, the
    last layer at the read token only); any other model runs them right-padded."""
    device = next(model.parameters()).device
    unique, index = distinct(sequences)
    if token_tree.supports(model, max(map(len, unique))):
        tree = token_tree.build(unique)
        pooled = token_tree.hidden_at(model, tree, *tree.reads(tree.lengths - 1, 1))
    else:
        ids, present = right_pad(unique)
        hidden = last_hidden_state(model, ids.to(device), present.to(device))
        pooled = hidden[torch.arange(len(unique), device=device), (present.sum(dim=1) - 1).to(device)]
    return head(pooled).reshape(len(unique))[index.to(device)]


def param_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    param = next(model.parameters())
    return param.dtype, param.device
