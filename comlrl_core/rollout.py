"""Sampling and scoring completions: one batched ``generate`` per (agent, prompt), one batched forward for log-probs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase


@dataclass
class Completions:
    """K sampled completions of one prompt, on CPU; ``mask`` covers each completion up to its first EOS."""

    prompt_ids: torch.Tensor  # [P]
    completion_ids: torch.Tensor  # [K, T]
    mask: torch.Tensor  # [K, T] bool
    texts: list[str]


def completion_mask(completion_ids: torch.Tensor, eos_ids: set[int]) -> torch.Tensor:
    """True on every token up to and including the first EOS; padding after it is never trained on."""
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for eos in eos_ids:
        is_eos |= completion_ids == eos
    after_eos = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) > 0
    return ~after_eos


def eos_ids(tokenizer: PreTrainedTokenizerBase, model: nn.Module) -> set[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    return {i for i in ids if i is not None}


def sample(model: nn.Module, tokenizer: PreTrainedTokenizerBase, prompt: str, k: int, generation: dict) -> Completions:
    """All K completions of ``prompt`` in one ``generate`` call (KV cache on, no autograd)."""
    device = next(model.parameters()).device
    encoded = tokenizer(prompt, return_tensors="pt", truncation=True)
    if encoded.input_ids.shape[1] == 0:
        raise ValueError(f"The prompt {prompt!r} encodes to no tokens; formatters must return non-empty prompts.")
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        out = model.generate(
            input_ids=encoded.input_ids.to(device),
            attention_mask=encoded.attention_mask.to(device),
            num_return_sequences=k,
            pad_token_id=tokenizer.pad_token_id,
            **generation,
        )
    model.train(was_training)
    out = out.cpu().clone()  # outside inference mode: a normal tensor that autograd may save
    prompt_len = encoded.input_ids.shape[1]
    completion_ids = out[:, prompt_len:]
    mask = completion_mask(completion_ids, eos_ids(tokenizer, model))
    texts = [tokenizer.decode(ids[m], skip_special_tokens=True) for ids, m in zip(completion_ids, mask)]
    return Completions(out[0, :prompt_len], completion_ids, mask, texts)


def actor_inputs(prompt_ids: torch.Tensor, completion_ids: torch.Tensor, mask: torch.Tensor):
    """``input_ids`` and ``attention_mask`` [K, P+T] for K completions of one prompt."""
    k = completion_ids.shape[0]
    input_ids = torch.cat([prompt_ids.expand(k, -1), completion_ids], dim=1)
    attention = torch.cat([torch.ones(k, prompt_ids.shape[0], dtype=torch.long), mask.long()], dim=1)
    return input_ids, attention


def completion_logprobs(logits: torch.Tensor, prompt_len: int, completion_ids: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs [K, T] of the completions from logits over prompt + completion; zero outside ``mask``."""
    length = completion_ids.shape[1]
    logits = logits[:, prompt_len - 1 : prompt_len - 1 + length].float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, completion_ids.to(logits.device).unsqueeze(-1)).squeeze(-1)
    return picked * mask.to(logits.device)


def token_logprobs(model: nn.Module, prompt_ids: torch.Tensor, completion_ids: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """log pi(token | prefix) for each completion token, zero outside ``mask``: [K, T], one batched forward.

    Gradients flow when called outside ``inference_mode``/``no_grad``.
    """
    device = next(model.parameters()).device
    input_ids, attention = actor_inputs(prompt_ids, completion_ids, mask)
    logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device), use_cache=False).logits
    return completion_logprobs(logits, prompt_ids.shape[0], completion_ids, mask)


def sequence_logprobs(model: nn.Module, prompt_ids: torch.Tensor, completion_ids: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """Sum of each completion's token log-probs over its mask: [K]."""
    return token_logprobs(model, prompt_ids, completion_ids, mask).sum(dim=1)


@torch.inference_mode()
def reference_kl(policy: nn.Module, reference: nn.Module, completions: Completions) -> list[float]:
    """Per-sequence k3 estimate of KL(policy || reference), summed over the completion's tokens."""
    args = (completions.prompt_ids, completions.completion_ids, completions.mask)
    log_ratio = token_logprobs(reference, *args).cpu() - token_logprobs(policy, *args).cpu()
    per_token = (torch.exp(log_ratio) - log_ratio - 1) * completions.mask
    return per_token.sum(dim=1).tolist()
