"""Tiny random-weight causal LMs and locally trained tokenizers, built offline.

Tests, the demo and the benchmarks load these through the same ``from_pretrained`` path a
Hugging Face id takes, so nothing is ever downloaded. Everything is deterministic in ``seed``:
the same seed writes byte-identical weights and tokenizer files.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

# Qwen2's own pre-tokenization (digits split one by one). transformers 5 loads any ``qwen2``
# directory with ``Qwen2Tokenizer``, which re-applies this split; training with it makes the
# reloaded tokenizer encode exactly like the one we saved, whatever the architecture.
_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_WORDS = (
    "agent agents cooperate team plan answer question solve write code function return value "
    "list sum count number result first second short long reply helper review test pass fail "
    "the a an and or of to in is it for with on as by this that we you they good bad yes no "
    "hello world story poem summary detail step reason think check final output input data"
).split()


@dataclass(frozen=True)
class TokenizerSpec:
    """A BPE vocabulary: size and special tokens (pad, eos, bos may coincide)."""

    vocab_size: int
    pad: str
    eos: str
    bos: str | None
    specials: tuple[str, ...]


@dataclass(frozen=True)
class TinyModelSpec:
    """One tiny model: architecture, tokenizer family and size."""

    name: str
    architecture: str  # "qwen2" or "llama"
    tokenizer: str  # key into TOKENIZERS
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


TOKENIZERS = {
    # Shared by the Qwen2 and Llama models: eos first, pad second (Qwen-like ids).
    "shared": TokenizerSpec(512, pad="<|pad|>", eos="<|endoftext|>", bos=None,
                            specials=("<|endoftext|>", "<|pad|>")),
    # A different vocabulary: other size, other special tokens, other ids.
    "other": TokenizerSpec(384, pad="<pad>", eos="</s>", bos="<s>", specials=("<pad>", "<s>", "</s>")),
}

TINY_MODELS = {
    spec.name: spec
    for spec in (
        TinyModelSpec("qwen2-tiny", "qwen2", "shared", 32, 2, 4, 2, 64),
        TinyModelSpec("qwen2-small", "qwen2", "shared", 48, 3, 4, 2, 96),
        TinyModelSpec("llama-tiny", "llama", "shared", 32, 2, 4, 2, 64),
        TinyModelSpec("llama-other-vocab", "llama", "other", 32, 2, 4, 2, 64),
    )
}

# ~10M parameters: big enough that compute, not Python overhead, dominates a benchmark step. Built
# only when named (``names=[...]``): the tests never need them.
BENCH_MODELS = {
    spec.name: spec
    for spec in (
        TinyModelSpec("qwen2-bench", "qwen2", "shared", 384, 6, 6, 2, 1024),
        TinyModelSpec("llama-bench", "llama", "shared", 384, 6, 6, 2, 1024),
    )
}
# A stable seed offset per model, so adding a model never changes another's weights.
_SEED_INDEX = {name: i for i, name in enumerate([*sorted(TINY_MODELS), *sorted(BENCH_MODELS)])}

_ARCHITECTURES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


def _corpus(seed: int, lines: int = 400) -> list[str]:
    """A small synthetic text: words, numbers and code-like lines, enough to fill the vocabularies."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12)))
        out.append(f"{words} {rng.randint(0, 9999)}.")
        if i % 5 == 0:
            out.append(f"def {rng.choice(_WORDS)}(x):\n    return x + {rng.randint(0, 99)}\n")
    return out


def build_tokenizer(spec: TokenizerSpec, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the synthetic corpus."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(spec.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=spec.pad, eos_token=spec.eos, bos_token=spec.bos,
        model_max_length=512,
    )


def build_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast, seed: int = 0):
    """Random-weight causal LM whose vocabulary and special ids match ``tokenizer``."""
    config_cls, model_cls = _ARCHITECTURES[spec.architecture]
    special = dict(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
    )
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        **special,
    )
    # fork_rng: building models must not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config = GenerationConfig(**special)
    return model.eval()


def build_tiny_models(out_dir: str | Path, seed: int = 0, names: list[str] | None = None) -> dict[str, Path]:
    """Write each tiny model (weights, config, generation config, tokenizer) under ``out_dir/NAME``.

    Returns ``{name: directory}``; each directory loads with ``AutoModelForCausalLM`` and
    ``AutoTokenizer.from_pretrained`` and no network.
    """
    names = list(TINY_MODELS) if names is None else names
    known = {**TINY_MODELS, **BENCH_MODELS}
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"names: unknown tiny models {unknown}; choose from {sorted(known)}.")
    out_dir = Path(out_dir)
    tokenizers_built: dict[str, PreTrainedTokenizerFast] = {}
    written = {}
    for name in names:
        spec = known[name]
        if spec.tokenizer not in tokenizers_built:
            tokenizers_built[spec.tokenizer] = build_tokenizer(TOKENIZERS[spec.tokenizer], seed)
        tokenizer = tokenizers_built[spec.tokenizer]
        model = build_model(spec, tokenizer, seed=seed * 1000 + _SEED_INDEX[name])
        target = out_dir / name
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
        written[name] = target
    return written
