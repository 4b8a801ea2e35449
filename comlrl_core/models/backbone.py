"""What the heads need from a Hugging Face causal LM: its width and its last hidden states."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..batching import cache_keyword, distinct, forward_on_prefixes, right_pad, share_prefixes
from ..decoding import hooked, rotate


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
    it (within float rounding): identical sequences run once (and score identically), common
    prefixes (K completions' prompt, a winner's and its loser's joint prompt) once where that pays
    (``batching.share_prefixes``), and the last decoder layer only where it is read (``_LastLayer``)."""
    device = next(model.parameters()).device
    unique, index = distinct(sequences)
    body = model.base_model
    length = max(map(len, unique))
    shared = share_prefixes(body, unique, [len(s) - 1 for s in unique], length) if body is not model else None
    if shared is None:
        ids, present = right_pad(unique)
    else:
        ids, present = right_pad([s[n:] for s, n in zip(unique, shared.lengths)])
    last = (present.sum(dim=1) - 1).to(device)
    apart = _LastLayer.of(body, length) if body is not model else None
    if apart is None:
        if shared is None:
            hidden = last_hidden_state(model, ids.to(device), present.to(device))
        else:
            hidden = forward_on_prefixes(body, shared, ids, present).last_hidden_state
        pooled = hidden[torch.arange(len(unique), device=device), last]
    else:
        if shared is None:
            run = apart(input_ids=ids.to(device), attention_mask=present.to(device), use_cache=False)
        else:
            run = forward_on_prefixes(body, shared, ids, present, run=apart)
        pooled = apart.at(run, last)
    return head(pooled).reshape(len(unique))[index.to(device)]


class _Stop(Exception):
    """Raised by a pre-hook on the last decoder layer to end the body's forward there."""


@dataclass
class _LastLayerInput:
    """The last decoder layer's input over every position [B, L, H] (and normed), its rotary tables
    [B, L, D], its keys and values over the cache's and these positions, and which keys are present."""

    hidden: torch.Tensor
    normed: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor


class _LastLayer:
    """A Llama-style body (Llama, Qwen2, Mistral) run with its last decoder layer apart: a scalar head
    reads one position per row, and that layer's queries, attention output, MLP and final norm are
    needed at that position only (its keys and values at every position). That layer is a sixth of
    the work in a 6-layer model, 1/L in general; the other layers and the attention mask are the
    model's own. Calling it runs the body up to the last layer (a pre-hook stops it there) and
    returns that layer's input with its keys and values (appended to the cache when one is passed)."""

    def __init__(self, body: nn.Module, keyword: str):
        self.body, self.keyword = body, keyword
        self.layer = body.layers[-1]

    @classmethod
    def of(cls, body: nn.Module, length: int) -> _LastLayer | None:
        """The body run this way, or None where that is not known to equal its forward on rows of up
        to ``length`` tokens (other architectures, dropout in training, hooks it would bypass)."""
        keyword = cache_keyword(body, length)
        config = body.config
        layers = getattr(body, "layers", None)
        if keyword is None or not layers or not hasattr(body, "norm") or getattr(config, "pretraining_tp", 1) != 1:
            return None
        if body.training and getattr(config, "attention_dropout", 0.0):
            return None
        layer = layers[-1]
        parts = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
        attention = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx")
        if not all(hasattr(layer, name) for name in parts) or not all(
                hasattr(layer.self_attn, name) for name in attention):
            return None
        return None if hooked(layer) else cls(body, keyword)

    def __call__(self, **forward) -> _LastLayerInput:
        seen = {}

        def stop(module, args, kwargs):
            seen.update(kwargs, hidden=args[0] if args else kwargs["hidden_states"])
            raise _Stop

        handle = self.layer.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            self.body(**forward)
        except _Stop:
            pass
        finally:
            handle.remove()
        attention, hidden = self.layer.self_attn, seen["hidden"]
        batch, length, _ = hidden.shape
        cos, sin = (t.expand(batch, -1, -1) for t in seen["position_embeddings"])
        normed = self.layer.input_layernorm(hidden)
        keys, values = (proj(normed).view(batch, length, -1, attention.head_dim).transpose(1, 2)
                        for proj in (attention.k_proj, attention.v_proj))
        keys = rotate(keys, cos[:, None], sin[:, None])
        cache = seen.get(self.keyword)
        if cache is not None:
            keys, values = cache.update(keys, values, attention.layer_idx)
        return _LastLayerInput(hidden, normed, cos, sin, keys, values, forward["attention_mask"])

    def at(self, run: _LastLayerInput, last: torch.Tensor) -> torch.Tensor:
        """The body's output [B, H] at position ``last[b]`` of each row b (its last present token:
        every key it may attend to is present in ``run.mask``)."""
        attention = self.layer.self_attn
        rows = torch.arange(last.shape[0], device=last.device)
        x = run.hidden[rows, last]
        query = attention.q_proj(run.normed[rows, last]).view(len(rows), -1, 1, attention.head_dim)
        query = rotate(query, run.cos[rows, last][:, None, None], run.sin[rows, last][:, None, None])
        attended = F.scaled_dot_product_attention(
            query, run.keys, run.values, attn_mask=run.mask.bool()[:, None, None, :], scale=attention.scaling,
            enable_gqa=query.shape[1] != run.keys.shape[1])
        x = x + attention.o_proj(attended.reshape(len(rows), -1))
        x = x + self.layer.mlp(self.layer.post_attention_layernorm(x))
        return self.body.norm(x)


def param_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    param = next(model.parameters())
    return param.dtype, param.device
