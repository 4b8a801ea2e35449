"""A lean sampler for Llama-style decoders (Llama, Qwen2, Mistral): the rollout's hot loop without
``generate``'s per-token machinery.

At RL rollout sizes (a few sequences of tens of tokens) a decode step costs reading the weights
plus Python overhead, not FLOPs, and Hugging Face ``generate`` spends about as long in its
per-step bookkeeping, cache objects and mask building as in the matmuls. This sampler prefills the
prompt once (``generate`` prefills it once per sample), writes keys and values into one
preallocated cache, runs q/k/v and gate/up as one matmul each on a GPU, and samples as
``generate`` does: the same temperature, top-k and top-p warpers, one ``multinomial`` draw per
step, padding after EOS, stopping when every sequence has ended. It runs only where it
reproduces ``generate`` (see ``lean_sample``); anything else returns None and the caller uses
``generate``. Several prompts sampled under the same weights (the items of one rollout buffer) decode
in the same steps, each drawing from its own generator as a call of its own would: a step's cost
grows far slower than its rows (the 10M benchmark model on one Xeon core: 3.6 ms for 4 rows, 4.6 ms
for 8).

On a GPU a decode step is kernel launches, not arithmetic: on an H200 a 0.36B-parameter bf16 step
took 9.6-10.7 ms launched op by op, 2.1-2.2 ms replayed as a CUDA graph, and reading its weights
takes 0.15 ms. So on CUDA the step is captured once per sampling call, with a fixed shape (one token per
row, attention over the whole preallocated cache with the positions not yet written masked out),
and replayed for every new token; sampling between the steps stays as it is.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig
from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

_MODEL_TYPES = {"llama", "qwen2", "mistral"}
_STATIC_ROPE = {"default", "linear", "llama3"}  # position tables that do not depend on the sequence length
_OPTIONS = {"do_sample", "temperature", "top_k", "top_p", "max_new_tokens"}
# Generation-config fields that leave sampling unchanged here (token ids are read separately).
_NEUTRAL = {"bos_token_id", "eos_token_id", "pad_token_id", "max_length", "use_cache", "transformers_version",
            "_from_model_config", "output_attentions", "output_hidden_states"}  # the last two: what generate returns
# Capturing the step costs 32-38 ms on an H200 (3.3-3.6 op-by-op steps) and each replay saves
# 7.5-8.4 ms, so from about 5 new tokens on it pays; 8 leaves a margin.
GRAPH_FROM_TOKENS = 8


def _cpu_features(cpuinfo: str = "/proc/cpuinfo") -> tuple[bool, bool]:
    """(AMD, AVX-512): whether MKL's decode-sized products read a weight that is not in cache slowly
    here (an AMD CPU; see ``_Product``), and whether reading it into cache first pays. Intel's stream
    it well (a Xeon with AMX: a small-model decode step 3.9-4.1 ms with plain ``F.linear``, 5.3-5.9 ms
    with the AMD path's ``weight @ x.T``). The read pays on a Zen 4 EPYC (AVX-512, a sum streaming
    25-29 GB/s) and costs on an EPYC that shows only AVX2 (a sum at 12 GB/s, hardly faster than
    the product's own read: a two-agent sampling call of one row 292 -> 255 ms without it)."""
    try:
        with open(cpuinfo) as info:
            lines = [line for line in info if line.startswith(("vendor_id", "flags"))][:2]
    except OSError:
        return False, False
    text = " ".join(lines)
    amd = "AuthenticAMD" in text
    return amd, amd and "avx512f" in text.split()


AMD_CPU, READ_FIRST = _cpu_features()


class _Product:
    """``x @ weight.T + bias`` for a decode step. On an AMD CPU MKL's few-row products read a weight
    that is not in cache at 6-10 GB/s, where a plain sum streams it at 25-29 GB/s (a Zen 4 EPYC
    core; the small model's 38 MB is more than its 32 MB L3), so there a large weight is either
    multiplied the other way round, ``weight @ x.T`` (the faster kernel for 2-4 rows), or, where
    that pays (``READ_FIRST``), first read by a sum, which leaves it in cache for ``F.linear`` (1
    row, 5 rows and more: for 8 rows a 1024x384 weight took 170 us so, 188 us transposed, 246 us
    plain). The transposed product equals ``F.linear``'s to rounding, the warmed one exactly; the
    choice per weight is made once, outside the hot loop."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias
        cpu = weight.device.type == "cpu"
        self.transposed = AMD_CPU and cpu and weight.numel() >= 1 << 17
        self.warmed = READ_FIRST and cpu and weight.numel() >= 1 << 15

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] * x.shape[1]
        if self.transposed and 2 <= rows <= 4:
            columns = x.reshape(rows, -1).t()
            out = torch.mm(self.weight, columns) if self.bias is None else torch.addmm(self.bias[:, None], self.weight, columns)
            return out.t().contiguous().view(*x.shape[:-1], -1)
        if self.warmed:
            self.weight.sum()  # read into cache; the sum itself is not needed
        return F.linear(x, self.weight, self.bias)


class _Projection:
    """Linears over the same input, their outputs side by side (q/k/v, gate/up), with their weights
    joined into one product (``join``: once per sampling call) or run apart. Joined on accelerators
    (one kernel instead of several), apart on the CPU, where copying the weights every call cost
    more than the extra products save (a Xeon: a small-model sampling call 70-73 ms apart, 83-87 ms
    joined)."""

    def __init__(self, linears: list[nn.Linear], join: bool):
        if len(linears) == 1 or not join:
            self.products = [_Product(m.weight, m.bias) for m in linears]
            return
        biases = [m.bias for m in linears]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else m.weight.new_zeros(m.out_features) for m, b in zip(linears, biases)])
        self.products = [_Product(torch.cat([m.weight for m in linears]), bias)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.products) == 1:
            return self.products[0](x)
        return torch.cat([product(x) for product in self.products], dim=-1)


@dataclass
class _Layer:
    """One decoder layer with q/k/v and gate/up side by side (built per call, so always the current weights)."""

    input_norm: nn.Module
    qkv: _Projection
    o_proj: _Projection
    post_norm: nn.Module
    gate_up: _Projection
    down_proj: _Projection
    act: nn.Module


def plain_decoder(model: nn.Module) -> bool:
    """A Llama-style decoder made of plain modules: no adapters, quantized layers, hooks or offloading."""
    config = getattr(model, "config", None)
    body = getattr(model, "model", None)
    if getattr(config, "model_type", None) not in _MODEL_TYPES or body is None or not hasattr(body, "layers"):
        return False
    if getattr(getattr(body, "rotary_emb", None), "rope_type", None) not in _STATIC_ROPE:
        return False
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return False
    if getattr(config, "pretraining_tp", 1) != 1 or getattr(model, "hf_device_map", None):
        return False
    linears = [model.lm_head] + [m for layer in body.layers for m in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    if any(type(m) is not nn.Linear for m in linears):
        return False
    return not hooked(model)


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule has forward or backward hooks or an accelerate hook, which a
    forward rewritten from its parts would bypass."""
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               or hasattr(m, "_hf_hook") for m in module.modules())


@functools.cache
def _generation_defaults() -> dict:
    return GenerationConfig().to_dict()


def _plain_sampling(model: nn.Module, generation: dict) -> bool:
    """Exactly the trainer's sampling options, and nothing in the model's generation config that
    would make ``generate`` do more (repetition penalty, min length, bad words, ...)."""
    if generation.keys() != _OPTIONS or generation["do_sample"] is not True:
        return False
    defaults = _generation_defaults()
    own = getattr(model, "generation_config", None)
    own = own.to_dict() if own is not None else {}
    return all(value == defaults.get(key) for key, value in own.items() if key not in _OPTIONS | _NEUTRAL)


def _warpers(generation: dict) -> list:
    """The warpers ``generate`` builds for these options, in its order."""
    warpers = []
    if generation["temperature"] is not None and generation["temperature"] != 1.0:
        warpers.append(TemperatureLogitsWarper(generation["temperature"]))
    if generation["top_k"] is not None and generation["top_k"] != 0:
        warpers.append(TopKLogitsWarper(top_k=generation["top_k"], min_tokens_to_keep=1))
    if generation["top_p"] is not None and generation["top_p"] < 1.0:
        warpers.append(TopPLogitsWarper(top_p=generation["top_p"], min_tokens_to_keep=1))
    return warpers


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding as Llama-style models apply it (halves rotated, not pairs)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Decoder:
    """The model's forward over new tokens, reading and extending a preallocated KV cache."""

    def __init__(self, model: nn.Module, rows: int, length: int, device: torch.device):
        config, body = model.config, model.model
        self.model, self.body = model, body
        attention = body.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.scale = attention.scaling
        self.layers = []
        join = device.type != "cpu"
        for layer in body.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(layer.input_layernorm, _Projection([a.q_proj, a.k_proj, a.v_proj], join),
                                      _Projection([a.o_proj], join), layer.post_attention_layernorm,
                                      _Projection([mlp.gate_proj, mlp.up_proj], join),
                                      _Projection([mlp.down_proj], join), mlp.act_fn))
        self.head = _Projection([model.lm_head], join)
        dtype = body.embed_tokens.weight.dtype
        shape = (rows, self.kv_heads, length, self.head_dim)
        # zeros, not empty: ``step`` weighs unwritten positions by 0, and 0 * NaN garbage would be NaN
        self.cache = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                      for _ in self.layers]
        positions = torch.arange(length, device=device)[None]
        self.cos, self.sin = body.rotary_emb(body.embed_tokens.weight[:1][None], positions)
        self.cos, self.sin = self.cos[:, None], self.sin[:, None]  # [1, 1, length, head_dim]

    def logits(self, ids: torch.Tensor, start: int, rows: slice = slice(None)) -> torch.Tensor:
        """float32 logits [B, V] after ``ids`` [B, L] placed at positions ``start..start+L-1`` of the
        cache ``rows`` (a batch of 1 is broadcast to them: a prompt shared by its samples)."""
        batch, length = ids.shape
        end = start + length

        def attend(keys, values, q, k, v):
            keys, values = keys[rows], values[rows]
            keys[:, :, start:end] = k
            values[:, :, start:end] = v
            return F.scaled_dot_product_attention(q, keys[:batch, :, :end], values[:batch, :, :end],
                                                  is_causal=length > 1, scale=self.scale,
                                                  enable_gqa=self.heads != self.kv_heads)

        return self._forward(ids, self.cos[..., start:end, :], self.sin[..., start:end, :], attend)

    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``logits`` for one token per row [B, 1], row b at ``positions[b]`` (a device tensor [B], or
        [1] for every row), with every shape fixed: rows whose prompts differ in length decode side
        by side, and a CUDA graph captures the step once and replays it at each position."""
        batch = ids.shape[0]
        positions = positions.expand(batch)
        visible = (torch.arange(self.cos.shape[2], device=ids.device) <= positions[:, None])[:, None, None]
        at = positions.view(batch, 1, 1, 1).expand(batch, self.kv_heads, 1, self.head_dim)  # row b's slot

        def attend(keys, values, q, k, v):
            keys.scatter_(2, at, k)
            values.scatter_(2, at, v)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=self.scale,
                                                  enable_gqa=self.heads != self.kv_heads)

        cos, sin = (table[0, 0, positions][:, None, None] for table in (self.cos, self.sin))  # [B, 1, 1, head_dim]
        return self._forward(ids, cos, sin, attend)

    def _forward(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """The layers over ``ids`` with their rotary tables; ``attend`` writes a layer's keys and
        values into its cache and attends over it."""
        batch, length = ids.shape
        x = self.body.embed_tokens(ids)
        for layer, (keys, values) in zip(self.layers, self.cache):
            heads = layer.qkv(layer.input_norm(x)).view(batch, length, self.heads + 2 * self.kv_heads, self.head_dim)
            qk, v = heads.split([self.heads + self.kv_heads, self.kv_heads], dim=2)
            q, k = rotate(qk.transpose(1, 2), cos, sin).split([self.heads, self.kv_heads], dim=1)  # q and k at once
            attended = attend(keys, values, q, k, v.transpose(1, 2))
            x = x + layer.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))
            gate, up = layer.gate_up(layer.post_norm(x)).chunk(2, dim=-1)
            x = x + layer.down_proj(layer.act(gate) * up)
        return self.head(self.body.norm(x[:, -1:])).squeeze(1).float()


class _GraphedStep:
    """``_Decoder.step`` captured as one CUDA graph: new tokens and positions are copied into fixed
    inputs, the graph replayed, and the logits read from its fixed output."""

    def __init__(self, decoder: _Decoder, positions: torch.Tensor):
        # Captured and replayed with the model's GPU current: the graph's streams are the current device's.
        self.device = positions.device
        self.token = torch.zeros(positions.shape[0], 1, dtype=torch.long, device=self.device)
        self.positions = positions.clone()
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture (kernel choices, workspaces)
                for _ in range(2):
                    decoder.step(self.token, self.positions)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: agents on other GPUs sample on their own threads meanwhile
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.logits = decoder.step(self.token, self.positions)

    def __call__(self, token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with torch.cuda.device(self.device):
            self.token.copy_(token[:, None])
            self.positions.copy_(positions)
            self.graph.replay()
        return self.logits


@torch.inference_mode()
def lean_sample(model: nn.Module, prompts: list[torch.Tensor], k: int, generation: dict, pad_token_id: int | None,
                generators: list[torch.Generator | None] | None = None) -> list[torch.Tensor] | None:
    """``k`` sampled continuations of each prompt [1, P] as ``generate`` returns them ([k, P+T],
    padded after EOS, T the steps until its own rows ended), or None when this model or these
    options need ``generate`` itself.

    Every prompt's rows decode in the same steps (one pass over the weights for all of them), and
    prompt j draws from ``generators[j]`` (None: the global generator) exactly as a call of its own
    would: one draw of its k rows per step until they have all ended."""
    if any(p.shape[0] != 1 for p in prompts) or not plain_decoder(model) or not _plain_sampling(model, generation):
        return None
    lengths, new = [p.shape[1] for p in prompts], generation["max_new_tokens"]
    window = getattr(model.config, "sliding_window", None)
    if window is not None and max(lengths) + new > window:
        return None
    device, n = prompts[0].device, len(prompts)
    generators = generators or [None] * n
    eos = model.generation_config.eos_token_id
    eos = torch.tensor([] if eos is None else eos if isinstance(eos, list) else [eos], device=device)
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos.numel() else None)
    warpers = _warpers(generation)
    decoder = _Decoder(model, n * k, max(lengths) + new, device)
    logits = torch.cat([decoder.logits(p, 0, slice(j * k, (j + 1) * k)).expand(k, -1) for j, p in enumerate(prompts)])
    positions = torch.tensor(lengths, device=device).repeat_interleave(k)  # each row's first new position
    # The warm-up and capture write each row's first decode position only, which its real step rewrites first.
    graphed = _GraphedStep(decoder, positions) if device.type == "cuda" and new >= GRAPH_FROM_TOKENS else None
    tokens, ended = [], [new] * n
    running = torch.ones(n * k, dtype=torch.bool, device=device)
    drawing = list(range(n))  # prompts with a row still running
    for step in range(new):
        for warp in warpers:
            logits = warp(None, logits)
        probs = torch.softmax(logits, dim=-1)
        token = torch.cat([torch.multinomial(probs[j * k:(j + 1) * k], 1, generator=generators[j]).squeeze(1)
                           if j in drawing else torch.full((k,), pad, device=device) for j in range(n)])
        if eos.numel():
            token = torch.where(running, token, pad)
            running &= ~torch.isin(token, eos)
            alive = running.view(n, k).any(dim=1).tolist()
            for j in [j for j in drawing if not alive[j]]:
                ended[j] = step + 1
            drawing = [j for j in drawing if alive[j]]
        tokens.append(token)
        if not drawing or step + 1 == new:
            break
        if graphed is not None:
            logits = graphed(token, positions + step)
        elif n == 1:  # one prompt: the cache up to this position, no mask
            logits = decoder.logits(token[:, None], lengths[0] + step)
        else:
            logits = decoder.step(token[:, None], positions + step)
    drawn = torch.stack(tokens, dim=1)
    return [torch.cat([p.expand(k, -1), drawn[j * k:(j + 1) * k, :ended[j]]], dim=1) for j, p in enumerate(prompts)]
