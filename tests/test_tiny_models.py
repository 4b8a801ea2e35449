import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl_core.tiny_models import TINY_MODELS, TOKENIZERS, build_tiny_models, build_tokenizer
from flows.cli import main

TEXTS = [
    "The agent 12345 says 67 hello",
    "def f(x):\n    return x + 1\n\n",
    "  spaces  and\ttabs, unicode é ü",
    "<|endoftext|> end",
]


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_every_model_loads_through_from_pretrained(tiny_models):
    architectures = set()
    for name, directory in tiny_models.items():
        model = AutoModelForCausalLM.from_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        architectures.add(model.config.model_type)
        assert model.config.vocab_size == len(tokenizer)
        for config in (model.config, model.generation_config):
            assert config.pad_token_id == tokenizer.pad_token_id is not None
            assert config.eos_token_id == tokenizer.eos_token_id is not None
        assert sum(p.numel() for p in model.parameters()) < 200_000, name
    assert architectures == {"qwen2", "llama"}


def test_two_sizes_share_a_tokenizer_and_one_model_has_another(tiny_models):
    shared = [n for n, s in TINY_MODELS.items() if s.tokenizer == "shared"]
    sizes = {TINY_MODELS[n].hidden_size for n in shared}
    assert len(sizes) >= 2
    vocab = {n: AutoTokenizer.from_pretrained(tiny_models[n]).get_vocab() for n in TINY_MODELS}
    assert all(vocab[n] == vocab[shared[0]] for n in shared)
    other = AutoTokenizer.from_pretrained(tiny_models["llama-other-vocab"])
    assert other.get_vocab() != vocab[shared[0]]
    assert len(other) != len(vocab[shared[0]])
    assert other.eos_token_id != AutoTokenizer.from_pretrained(tiny_models["qwen2-tiny"]).eos_token_id


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_reloaded_tokenizer_encodes_exactly_like_the_saved_one(tiny_models, name):
    # transformers 5 reloads qwen2 directories as Qwen2Tokenizer, which re-splits digits.
    original = build_tokenizer(TOKENIZERS[TINY_MODELS[name].tokenizer])
    reloaded = AutoTokenizer.from_pretrained(tiny_models[name])
    for text in TEXTS:
        assert reloaded(text).input_ids == original(text).input_ids, (name, text)
        assert reloaded.decode(reloaded(text).input_ids) == text


def test_builds_are_deterministic_in_the_seed(tmp_path):
    a = build_tiny_models(tmp_path / "a", seed=3, names=["qwen2-tiny"])["qwen2-tiny"]
    b = build_tiny_models(tmp_path / "b", seed=3, names=["qwen2-tiny"])["qwen2-tiny"]
    c = build_tiny_models(tmp_path / "c", seed=4, names=["qwen2-tiny"])["qwen2-tiny"]
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]


def test_building_does_not_disturb_the_callers_rng(tmp_path):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_tiny_models(tmp_path, names=["llama-tiny"])
    assert torch.equal(torch.rand(3), expected)


def test_a_generation_and_a_training_step_run(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2-tiny"])
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2-tiny"])
    batch = tokenizer(["hello agent", "write code"], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=5, do_sample=True)
    assert out.shape[1] <= batch.input_ids.shape[1] + 5
    loss = model(**batch, labels=batch.input_ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_unknown_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny models"):
        build_tiny_models(tmp_path, names=["gpt-5"])


def test_cli_writes_the_models(tmp_path, capsys):
    assert main(["tiny-models", str(tmp_path), "--names", "qwen2-tiny", "llama-other-vocab"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-other-vocab", "qwen2-tiny"]
    assert "qwen2-tiny" in capsys.readouterr().out
    assert main(["tiny-models", str(tmp_path / "x"), "--names", "nope"]) == 2
    assert "unknown tiny models" in capsys.readouterr().err


def test_cli_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "tiny-models" in capsys.readouterr().out
