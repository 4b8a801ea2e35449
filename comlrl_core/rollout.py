"""Sampling and scoring completions: one batched sampling call per (agent, prompt), one batched forward for log-probs."""

from __future__ import annotations

import contextlib
import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedTokenizerBase

from .decoding import lean_sample


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


def generate_ids(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, k: int, generation: dict,
                 pad_token_id: int | None) -> torch.Tensor:
    """``k`` sampled sequences [k, P+T] of one prompt: the lean sampler where it reproduces
    ``generate`` (Llama-style models, the trainer's sampling options), else ``generate`` itself."""
    out = lean_sample(model, input_ids, k, generation, pad_token_id)
    if out is None:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, num_return_sequences=k,
                             pad_token_id=pad_token_id, **generation)
    return out


def _encode(tokenizer: PreTrainedTokenizerBase, prompt: str):
    encoded = tokenizer(prompt, return_tensors="pt", truncation=True)
    if encoded.input_ids.shape[1] == 0:
        raise ValueError(f"The prompt {prompt!r} encodes to no tokens; formatters must return non-empty prompts.")
    return encoded


def _draw(model: nn.Module, encoded, k: int, generation: dict, pad_token_id: int | None) -> torch.Tensor:
    """The sampling call on the model's device: [k, P+T] ids on the CPU (no tokenizer: thread-safe per device)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        out = generate_ids(model, encoded.input_ids.to(device), encoded.attention_mask.to(device), k, generation,
                           pad_token_id)
    model.train(was_training)
    return out.cpu().clone()  # outside inference mode: a normal tensor that autograd may save


def sample(model: nn.Module, tokenizer: PreTrainedTokenizerBase, prompt: str, k: int, generation: dict) -> Completions:
    """All K completions of ``prompt`` in one sampling call (KV cache on, no autograd)."""
    encoded = _encode(tokenizer, prompt)
    return _completions(model, tokenizer, encoded, _draw(model, encoded, k, generation, tokenizer.pad_token_id))


def _worker_devices(devices: list[torch.device]) -> list[torch.device]:
    """The devices ``sample_agents`` gives a worker thread: each CUDA device, when there are two or
    more. Each CUDA device has its own generator; the CPU's is global, so CPU sampling stays on the
    calling thread (threads would interleave its draws)."""
    cuda = list(dict.fromkeys(d for d in devices if d.type == "cuda"))
    return cuda if len(cuda) > 1 else []


def sample_agents(policies: list[nn.Module], tokenizers: list[PreTrainedTokenizerBase], prompts: list[str], k: int,
                  generation: dict) -> list[Completions]:
    """``[sample(policies[i], tokenizers[i], prompts[i], k, generation) for i ...]``, with agents on
    different CUDA devices sampling at the same time.

    With policies on more than one CUDA device, each device's agents sample in order on one
    worker thread per device (so every device's generator sees the same draws as one after
    another), and CPU agents on the calling thread meanwhile; tokenizers are only used on the
    calling thread. The results equal the sequential ones. Otherwise it is the plain loop.
    """
    if not len(policies) == len(tokenizers) == len(prompts):
        raise ValueError(f"sample_agents: {len(policies)} policies, {len(tokenizers)} tokenizers and "
                         f"{len(prompts)} prompts; give one of each per agent.")
    devices = [next(p.parameters()).device for p in policies]
    threaded = _worker_devices(devices)
    if not threaded:
        return [sample(p, t, q, k, generation) for p, t, q in zip(policies, tokenizers, prompts)]
    groups: dict[torch.device, list[int]] = {}
    for i, device in enumerate(devices):
        groups.setdefault(device, []).append(i)
    encoded = [_encode(t, q) for t, q in zip(tokenizers, prompts)]
    drawn: list[torch.Tensor | None] = [None] * len(policies)

    def draw(indices: list[int]) -> None:
        for i in indices:
            drawn[i] = _draw(policies[i], encoded[i], k, generation, tokenizers[i].pad_token_id)

    def draw_on(device: torch.device, indices: list[int]) -> None:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            draw(indices)

    with ThreadPoolExecutor(max_workers=len(threaded), thread_name_prefix="sample-agents") as pool:
        futures = [pool.submit(draw_on, d, groups[d]) for d in threaded]
        for device, indices in groups.items():
            if device not in threaded:
                draw(indices)
        for future in futures:
            future.result()
    return [_completions(p, t, e, out) for p, t, e, out in zip(policies, tokenizers, encoded, drawn)]


def _completions(model: nn.Module, tokenizer: PreTrainedTokenizerBase, encoded, out: torch.Tensor) -> Completions:
    prompt_len = encoded.input_ids.shape[1]
    completion_ids = out[:, prompt_len:]
    mask = completion_mask(completion_ids, eos_ids(tokenizer, model))
    texts = [tokenizer.decode(ids[m], skip_special_tokens=True) for ids, m in zip(completion_ids, mask)]
    return Completions(out[0, :prompt_len], completion_ids, mask, texts)


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


@dataclass
class ActorBatch:
    """Prompt + completion rows, right-padded into one forward pass.

    Right padding keeps every real token at the position it has alone, so each row's log-probs
    equal those of its own forward; ``starts`` holds each row's prompt length.
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    starts: torch.Tensor  # [B]
    completion_ids: torch.Tensor  # [B, T], zero-padded
    mask: torch.Tensor  # [B, T] bool, False on padding


def actor_batch(rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> ActorBatch:
    """One batch from ``(prompt_ids [P], completion_ids [T], mask [T])`` rows of any lengths."""
    input_ids, _ = right_pad([torch.cat([p, c]) for p, c, _ in rows])
    attention, _ = right_pad([torch.cat([torch.ones_like(p), m.long()]) for p, _, m in rows])
    completion_ids, _ = right_pad([c for _, c, _ in rows])
    mask, _ = right_pad([m for _, _, m in rows])
    starts = torch.tensor([p.shape[0] for p, _, _ in rows])
    return ActorBatch(input_ids, attention, starts, completion_ids, mask)


def completion_logprobs(logits: torch.Tensor, batch: ActorBatch) -> torch.Tensor:
    """Per-token log-probs [B, T] of each row's completion from logits over the batch; zero outside ``mask``."""
    device = logits.device
    positions = (batch.starts[:, None] - 1 + torch.arange(batch.completion_ids.shape[1])).clamp_max(logits.shape[1] - 1)
    picked_logits = logits.gather(1, positions.to(device)[..., None].expand(-1, -1, logits.shape[-1])).float()
    picked = torch.log_softmax(picked_logits, dim=-1).gather(-1, batch.completion_ids.to(device)[..., None]).squeeze(-1)
    return picked * batch.mask.to(device)


_PREFIX_SHARING = {"llama", "qwen2", "mistral"}  # decoders whose forward on a cache is tested equal to the full one
# Running the prompts apart costs one more pass over the weights (read, weight gradient, its
# accumulation): worth it from about this many prompt tokens saved. CPU: the crossover measured
# with the 10M benchmark model (see the README); other devices: an estimate, launch- and
# bandwidth-bound small passes on a GPU cost about as much as a few hundred tokens.
_SHARING_PAYS_FROM = {"cpu": 32}
_SHARING_PAYS_FROM_ELSEWHERE = 512


def _cache_keyword(model: nn.Module, length: int) -> str | None:
    """The forward's cache argument (``cache`` in newer transformers, ``past_key_values`` before), or
    None where running a prompt once and its completions on its cache is not known to equal the full
    forward of ``length`` tokens: other architectures, sliding windows shorter than that, gradient
    checkpointing (which turns the cache off)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in _PREFIX_SHARING:
        return None
    if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        return None
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return None
    window = getattr(config, "sliding_window", None)
    if window is not None and length > window:
        return None
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def _on_shared_prompts(model: nn.Module, rows, prompts: list[torch.Tensor], groups: torch.Tensor,
                       keyword: str) -> torch.Tensor:
    """``token_logprobs`` with each distinct prompt run once: its first P-1 tokens fill a cache, which
    is indexed out to the rows, and each row then runs [last prompt token, completion[:-1]] at
    positions P-1.. on it, so every logit it needs comes from that second forward."""
    device = next(model.parameters()).device
    prefix_ids, prefix_mask = right_pad([p[:-1] for p in prompts])
    completion_ids, _ = right_pad([c for _, c, _ in rows])
    keep, _ = right_pad([m for _, _, m in rows])
    width = completion_ids.shape[1]
    last = torch.stack([p[-1] for p in prompts])[groups]
    tail_ids = torch.cat([last[:, None], completion_ids[:, :-1]], dim=1)
    # Causal attention never lets a kept token read the padding after an EOS, so no mask is needed there.
    tail_mask = torch.cat([prefix_mask[groups], torch.ones(len(rows), width, dtype=torch.long)], dim=1)
    positions = prefix_mask.sum(dim=1)[groups][:, None] + torch.arange(width)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix_ids.to(device), attention_mask=prefix_mask.to(device), use_cache=True, logits_to_keep=1,
          **{keyword: cache})
    cache.batch_select_indices(groups.to(device))
    logits = model(input_ids=tail_ids.to(device), attention_mask=tail_mask.to(device),
                   position_ids=positions.to(device), use_cache=True, **{keyword: cache}).logits
    picked = torch.log_softmax(logits.float(), dim=-1).gather(-1, completion_ids.to(device)[..., None]).squeeze(-1)
    return picked * keep.to(device)


def token_logprobs(model: nn.Module, rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """log pi(token | prefix) of each ``(prompt_ids, completion_ids, mask)`` row's completion, zero
    outside its mask: [B, T]. Gradients flow outside ``inference_mode``.

    Rows that share a prompt (a sample's K completions) run it once, and their completions read its
    keys and values: the arithmetic of the full rows without K-1 copies of the prompt (equal within
    float rounding, tested), used where that saves enough tokens to pay for the second pass. Otherwise,
    or where it is not known to hold (see ``_cache_keyword``), one right-padded forward of the full rows.
    """
    device = next(model.parameters()).device
    prompts, groups = distinct([p for p, _, _ in rows])
    saved = sum(len(p) - 1 for p, _, _ in rows) - sum(len(p) - 1 for p in prompts)
    if saved >= _SHARING_PAYS_FROM.get(device.type, _SHARING_PAYS_FROM_ELSEWHERE) and min(map(len, prompts)) > 1:
        keyword = _cache_keyword(model, max(p.shape[0] + c.shape[0] for p, c, _ in rows))
        if keyword is not None:
            return _on_shared_prompts(model, rows, prompts, groups, keyword)
    batch = actor_batch(rows)
    logits = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                   use_cache=False).logits
    return completion_logprobs(logits, batch)


@torch.inference_mode()
def reference_kl(policy: nn.Module, reference: nn.Module, completions: Completions) -> list[float]:
    """Per-sequence k3 estimate of KL(policy || reference), summed over the completion's tokens."""
    rows = [(completions.prompt_ids, c, m) for c, m in zip(completions.completion_ids, completions.mask)]
    log_ratio = token_logprobs(reference, rows).cpu() - token_logprobs(policy, rows).cpu()
    per_token = (torch.exp(log_ratio) - log_ratio - 1) * completions.mask
    return per_token.sum(dim=1).tolist()
