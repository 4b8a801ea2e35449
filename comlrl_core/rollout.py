"""Sampling and scoring completions: one batched sampling call per agent (over one item or several),
one batched forward for log-probs."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from . import token_tree
from .batching import right_pad
from .decoding import lean_sample

# Rows one sampling call takes where many items wait under the same weights (an evaluation, a
# preference collection): enough that a decode step's weight reads serve many rows.
ROWS_PER_CALL = 64


@dataclass
class Completions:
    """K sampled completions of one prompt, on CPU; ``mask`` covers each completion up to its first EOS."""

    prompt_ids: torch.Tensor  # [P]
    completion_ids: torch.Tensor  # [K, T]
    mask: torch.Tensor  # [K, T] bool
    texts: list[str]
    seconds: float = 0.0  # this prompt's share of its sampling call's wall time


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


class ItemDraws:
    """One item's sampling stream: a generator per device, seeded with the item's seed (the stream
    that seeding the global generators before the item gave), so that the item draws the same tokens
    whichever other items share its sampling calls. ``ahead`` keeps its first turn when that was
    sampled together with other items' (``sample_items``); ``sample_agents`` hands it out once."""

    def __init__(self, seed: int):
        self.seed = seed
        self.ahead: tuple[list[str], int, list[Completions]] | None = None
        self._generators: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[device]

    def take_ahead(self, prompts: list[str], k: int) -> list[Completions] | None:
        ahead, self.ahead = self.ahead, None
        return ahead[2] if ahead is not None and ahead[:2] == (list(prompts), k) else None


@contextlib.contextmanager
def _global_stream(generator: torch.Generator | None):
    """The global generator of ``generator``'s device runs ``generator``'s stream meanwhile (for
    ``generate``, which takes no generator); None leaves it as it is."""
    if generator is None:
        yield
        return
    device = generator.device
    cuda = device.type == "cuda"
    own = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    (torch.cuda.set_rng_state(generator.get_state(), device) if cuda else torch.set_rng_state(generator.get_state()))
    try:
        yield
    finally:
        generator.set_state(torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state())
        torch.cuda.set_rng_state(own, device) if cuda else torch.set_rng_state(own)


def generate_ids(model: nn.Module, prompts: list[torch.Tensor], k: int, generation: dict, pad_token_id: int | None,
                 generators: list[torch.Generator | None] | None = None) -> list[torch.Tensor]:
    """``k`` sampled sequences [k, P+T] of each prompt [1, P], prompt j drawing from
    ``generators[j]`` (None: the global generator): the lean sampler where it reproduces
    ``generate`` (Llama-style models, the trainer's sampling options; all prompts in the same decode
    steps), else ``generate`` itself, prompt by prompt."""
    generators = generators or [None] * len(prompts)
    out = lean_sample(model, prompts, k, generation, pad_token_id, generators)
    if out is None:
        out = []
        for prompt, generator in zip(prompts, generators):
            with _global_stream(generator):
                out.append(model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                          num_return_sequences=k, pad_token_id=pad_token_id, **generation))
    return out


def _encode(tokenizer: PreTrainedTokenizerBase, prompt: str) -> torch.Tensor:
    bos = tokenizer.bos_token  # a chat template's text already starts with it: never add a second one
    ids = tokenizer(prompt, return_tensors="pt", truncation=True,
                    add_special_tokens=not (bos and prompt.startswith(bos))).input_ids
    if ids.shape[1] == 0:
        raise ValueError(f"The prompt {prompt!r} encodes to no tokens; formatters must return non-empty prompts.")
    return ids


@contextlib.contextmanager
def _dropout_off(model: nn.Module):
    """Every module in eval mode meanwhile, then each back in the mode it was in. The flags are set
    directly rather than through ``train()``/``eval()``: a transformers model loaded with hub kernels
    (5.25's default) re-kernelizes itself on every mode change (~1 ms, twice per sampling call)."""
    modes = [(m, m.training) for m in model.modules()]
    for m, _ in modes:
        m.training = False
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _draw(model: nn.Module, prompts: list[torch.Tensor], k: int, generation: dict, pad_token_id: int | None,
          draws: list[ItemDraws | None]) -> list[torch.Tensor]:
    """The sampling call on the model's device: [k, P+T] ids per prompt, on the CPU (no tokenizer:
    thread-safe per device)."""
    device = next(model.parameters()).device
    generators = [d.on(device) if d is not None else None for d in draws]
    with _dropout_off(model), torch.inference_mode():
        out = generate_ids(model, [p.to(device) for p in prompts], k, generation, pad_token_id, generators)
    return [o.cpu().clone() for o in out]  # outside inference mode: normal tensors that autograd may save


def sample(model: nn.Module, tokenizer: PreTrainedTokenizerBase, prompt: str, k: int, generation: dict) -> Completions:
    """All K completions of ``prompt`` in one sampling call (KV cache on, no autograd)."""
    ids = _encode(tokenizer, prompt)
    return _completions(model, tokenizer, ids, _draw(model, [ids], k, generation, tokenizer.pad_token_id, [None])[0])


def _worker_devices(devices: list[torch.device]) -> list[torch.device]:
    """The devices ``sample_items`` gives a worker thread: each CUDA device, when there are two or
    more. Each CUDA device has its own generator; the CPU's is global, so CPU sampling stays on the
    calling thread (threads would interleave its draws)."""
    cuda = list(dict.fromkeys(d for d in devices if d.type == "cuda"))
    return cuda if len(cuda) > 1 else []


def sample_agents(policies: list[nn.Module], tokenizers: list[PreTrainedTokenizerBase], prompts: list[str], k: int,
                  generation: dict, draws: ItemDraws | None = None) -> list[Completions]:
    """One item's K completions per agent, ``prompts[i]`` for agent i: ``sample_items`` of this item
    alone, or what it already sampled of these prompts (``draws.ahead``)."""
    ahead = draws.take_ahead(prompts, k) if draws is not None else None
    return ahead if ahead is not None else sample_items(policies, tokenizers, [prompts], k, generation, [draws])[0]


def sample_items(policies: list[nn.Module], tokenizers: list[PreTrainedTokenizerBase], prompts: list[list[str]],
                 k: int, generation: dict, draws: list[ItemDraws | None]) -> list[list[Completions]]:
    """Per item n, per agent i, K completions of ``prompts[n][i]``: one sampling call per agent over
    every item (their rows decode together), item n drawing from ``draws[n]`` (None: the global
    generators, in order).

    With policies on more than one CUDA device, each device's agents sample in order on one
    worker thread per device (so every device's generator sees the same draws as one after
    another), and CPU agents on the calling thread meanwhile; tokenizers are only used on the
    calling thread. The results equal the sequential ones. Otherwise it is the plain loop.
    """
    if not all(len(policies) == len(tokenizers) == len(p) for p in prompts) or len(draws) != len(prompts):
        raise ValueError(f"sample_items: {len(policies)} policies, {len(tokenizers)} tokenizers, prompts for "
                         f"{sorted({len(p) for p in prompts})} agents and {len(draws)} draws for {len(prompts)} "
                         "items; give one prompt per agent and one draws per item.")
    devices = [next(p.parameters()).device for p in policies]
    encoded = [[_encode(t, q[i]) for q in prompts] for i, t in enumerate(tokenizers)]  # [agent][item]
    drawn: list[list[torch.Tensor] | None] = [None] * len(policies)

    seconds = [0.0] * len(policies)

    def draw(indices: list[int]) -> None:
        for i in indices:
            started = time.perf_counter()
            drawn[i] = _draw(policies[i], encoded[i], k, generation, tokenizers[i].pad_token_id, draws)
            seconds[i] = (time.perf_counter() - started) / len(prompts)

    threaded = _worker_devices(devices)
    if not threaded:
        draw(list(range(len(policies))))
    else:
        for d in (d for d in draws if d is not None):  # the generators exist before the threads use them
            for device in threaded:
                d.on(device)
        groups: dict[torch.device, list[int]] = {}
        for i, device in enumerate(devices):
            groups.setdefault(device, []).append(i)

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
    return [[_completions(p, t, encoded[i][n], drawn[i][n], seconds[i])
             for i, (p, t) in enumerate(zip(policies, tokenizers))] for n in range(len(prompts))]


def _completions(model: nn.Module, tokenizer: PreTrainedTokenizerBase, prompt_ids: torch.Tensor,
                 out: torch.Tensor, seconds: float = 0.0) -> Completions:
    prompt_len = prompt_ids.shape[1]
    completion_ids = out[:, prompt_len:]
    mask = completion_mask(completion_ids, eos_ids(tokenizer, model))
    texts = [tokenizer.decode(ids[m], skip_special_tokens=True) for ids, m in zip(completion_ids, mask)]
    return Completions(out[0, :prompt_len], completion_ids, mask, texts, seconds)


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
    """Per-token log-probs [B, T] of each row's completion from ``rows_forward``'s logits (position
    ``starts - 1 + t`` at index t); zero outside ``mask``."""
    device = logits.device
    logits = logits[:, :batch.completion_ids.shape[1]].float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, batch.completion_ids.to(device)[..., None]).squeeze(-1)
    return picked * batch.mask.to(device)


def rows_forward(model: nn.Module, rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], *,
                 last_position: bool = True, hidden: bool = False) -> tuple[torch.Tensor, ActorBatch]:
    """A causal LM's logits (``hidden=True``: its body's final hidden states) over ``(prompt_ids,
    completion_ids, mask)`` rows, read at positions ``starts - 1 + t`` for t < W: [B, W, V or H], with
    W the longest completion, plus one with ``last_position`` (each completion's last token, where a
    Q-value is read); and the rows' ``ActorBatch``.

    A Llama-style decoder runs the rows as one prefix tree (``token_tree``): the prompt a sample's K
    completions share once, each completion up to its mask's end only, the last layer at the read
    positions only. Any other model (or a mask with holes) runs one right-padded forward of the rows.
    """
    batch = actor_batch(rows)
    width = batch.completion_ids.shape[1] + int(last_position)
    ends = batch.mask.sum(dim=1)
    prefix_masks = bool((batch.mask == (torch.arange(batch.mask.shape[1]) < ends[:, None])).all())
    if prefix_masks and token_tree.supports(model, batch.input_ids.shape[1]):
        fed = (ends - (0 if last_position else 1)).clamp_min(0).tolist()  # completion tokens each row feeds
        tree = token_tree.build([torch.cat([p, c[:n]]) for (p, c, _), n in zip(rows, fed)])
        out = token_tree.hidden_at(model, tree, *tree.reads(batch.starts - 1, width))
        return (out if hidden else model.get_output_embeddings()(out)), batch
    device = next(model.parameters()).device
    end = None if last_position else -1
    forward = dict(input_ids=batch.input_ids[:, :end].to(device),
                   attention_mask=batch.attention_mask[:, :end].to(device), use_cache=False)
    out = model.base_model(**forward).last_hidden_state if hidden else model(**forward).logits
    positions = (batch.starts[:, None] - 1 + torch.arange(width)).clamp_max(out.shape[1] - 1).to(device)
    return out.gather(1, positions[..., None].expand(-1, -1, out.shape[-1])), batch


def token_logprobs(model: nn.Module, rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """log pi(token | prefix) of each ``(prompt_ids, completion_ids, mask)`` row's completion, zero
    outside its mask: [B, T], from one ``rows_forward``. Gradients flow outside ``inference_mode``."""
    logits, batch = rows_forward(model, rows, last_position=False)
    return completion_logprobs(logits, batch)


@torch.inference_mode()
def reference_kl(policy: nn.Module, reference: nn.Module, completions: Completions) -> list[float]:
    """Per-sequence k3 estimate of KL(policy || reference), summed over the completion's tokens."""
    rows = [(completions.prompt_ids, c, m) for c, m in zip(completions.completion_ids, completions.mask)]
    log_ratio = token_logprobs(reference, rows).cpu() - token_logprobs(policy, rows).cpu()
    per_token = (torch.exp(log_ratio) - log_ratio - 1) * completions.mask
    return per_token.sum(dim=1).tolist()
