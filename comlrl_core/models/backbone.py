"""What the heads need from a Hugging Face causal LM: its width and its last hidden states."""

from __future__ import annotations

import torch
from torch import nn


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


def param_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    param = next(model.parameters())
    return param.dtype, param.device
