"""Tokenizer rules: who loads them, list lengths, pad tokens, and vocabulary compatibility."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..models import CausalLMWithValueHead
from .sources import Source, _as_list, is_model_object, local_dir, same_name, source_name, vocab_size

# Files that hold a vocabulary; tokenizer_config.json alone does not (AutoTokenizer then builds a near-empty one).
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model")


def load_tokenizer(source: str, label: str = "tokenizer", trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A tokenizer from an id or directory; a directory without a vocabulary file is refused, since
    ``AutoTokenizer`` would silently build a near-empty one from the configs alone."""
    path = local_dir(source, label)
    if path is not None and not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ValueError(f"{label}={source!r}: directory holds no tokenizer vocabulary file (one of "
                         f"{list(_TOKENIZER_FILES)}), so it is missing or incomplete; save the tokenizer there with "
                         "tokenizer.save_pretrained(dir).")
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    return ensure_pad_token(tokenizer, f"{label}={source!r}")


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase, label: str = "tokenizer") -> PreTrainedTokenizerBase:
    """Batched generation needs a pad id: fall back to eos, as Hugging Face recipes do."""
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"{label} must be a Hugging Face tokenizer, got {type(tokenizer).__name__}.")
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise ValueError(f"{label} has no eos token; set tokenizer.eos_token (and pad_token) before training.")
    return tokenizer


def resolve_tokenizers(
    tokenizer: object,
    sources: list[Source],
    *,
    agent_model: object,
    agents_given: bool,
    family: str,
    owner: str,
    trust_remote_code: bool = False,
) -> list[PreTrainedTokenizerBase]:
    """One tokenizer per agent, following the seed.

    ``family="magrpo"`` auto-loads a tokenizer per string source; ``family="actor_critic"``
    auto-loads only for ``agent_model`` and requires ``tokenizer`` whenever ``agents`` is given.
    A list is always honoured (the reference ignores it for IAC/MAAC with ``agent_model``).
    """
    count = len(sources)
    if tokenizer is None:
        if family == "actor_critic" and agents_given:
            raise ValueError(
                f"{owner}: tokenizer is required when agents is given (even as ids or directories). Pass "
                "tokenizer=[AutoTokenizer.from_pretrained(a) for a in agents], or one shared tokenizer."
            )
        for i, source in enumerate(sources):
            if is_model_object(source):
                where = "agent_model" if not agents_given else f"agents[{i}]"
                raise ValueError(
                    f"{owner}: {where} is a loaded model object, so no tokenizer can be loaded for it. Pass "
                    "tokenizer=<one shared tokenizer> or a list with one tokenizer per agent."
                )
        loaded: dict[str, PreTrainedTokenizerBase] = {}
        for i, source in enumerate(sources):
            if source not in loaded:
                loaded[source] = load_tokenizer(source, "agent_model" if not agents_given else f"agents[{i}]",
                                                trust_remote_code)
        return [loaded[source] for source in sources]
    if isinstance(tokenizer, (list, tuple)):
        entries = _as_list(tokenizer, "tokenizer")
        if len(entries) != count:
            raise ValueError(
                f"{owner}: tokenizer has {len(entries)} entries but there are {count} agents; give one tokenizer "
                "per agent, in agent order, or a single shared tokenizer."
            )
        return [
            load_tokenizer(os.fspath(entry), f"tokenizer[{i}]", trust_remote_code)
            if isinstance(entry, (str, os.PathLike)) else ensure_pad_token(entry, f"tokenizer[{i}]")
            for i, entry in enumerate(entries)
        ]
    if isinstance(tokenizer, (str, os.PathLike)):
        return [load_tokenizer(os.fspath(tokenizer), trust_remote_code=trust_remote_code)] * count
    return [ensure_pad_token(tokenizer)] * count


def _own_tokenizer_dir(source: Source) -> str | None:
    name = source_name(source)
    if name and Path(name).expanduser().is_dir() and any((Path(name).expanduser() / f).is_file() for f in _TOKENIZER_FILES):
        return name
    return None


def check_vocab_compatible(tokenizer: PreTrainedTokenizerBase, source: Source, *, role: str, tokenizer_label: str,
                           trust_remote_code: bool = False) -> None:
    """Refuse a tokenizer whose ids the model cannot embed, before a forward pass fails deep in torch.

    Two checks: every id the tokenizer can emit (vocabulary, added and special tokens) must be
    below the model's embedding size; and where the model's directory ships its own tokenizer,
    both vocabularies must map tokens to the same ids.
    """
    rows = vocab_size(source, trust_remote_code)
    special_ids = [i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) if i is not None]
    highest = max([len(tokenizer) - 1, *special_ids])
    if highest >= rows:
        raise ValueError(
            f"{role} ({source_name(source) or type(source).__name__}) has {rows} embedding rows but {tokenizer_label} "
            f"emits ids up to {highest}: their vocabularies are incompatible. Give {role} a model that uses "
            f"{tokenizer_label}'s vocabulary (for a critic: the same model family as its actor)."
        )
    own = _own_tokenizer_dir(source)
    if own is None or same_name(own, getattr(tokenizer, "name_or_path", "") or ""):
        return
    if load_tokenizer(own, trust_remote_code=trust_remote_code).get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"{role} ({own}) was trained with a different vocabulary than {tokenizer_label}: the same ids mean "
            f"different tokens. Use a model that shares {tokenizer_label}'s tokenizer."
        )


def apply_tokenizer_specials(tokenizer: PreTrainedTokenizerBase, model) -> None:
    """Pad with the tokenizer's pad id; keep a model's own eos ids (some stop on several) unless it has none."""
    base = model.model if isinstance(model, CausalLMWithValueHead) else model
    for config in (base.config, getattr(base, "generation_config", None)):
        if config is not None:
            config.pad_token_id = tokenizer.pad_token_id
            if getattr(config, "eos_token_id", None) is None:
                config.eos_token_id = tokenizer.eos_token_id
