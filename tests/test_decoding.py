"""The lean sampler draws exactly what Hugging Face ``generate`` draws, and steps aside where it cannot."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from comlrl_core.decoding import lean_sample

SETTINGS = [
    {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 12},
    {"do_sample": True, "temperature": 0.6, "top_p": 0.6, "top_k": 0, "max_new_tokens": 20},
    {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 7, "max_new_tokens": 6},
]


def _generate(model, prompt, k, generation, pad=1):
    with torch.inference_mode():
        return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), num_return_sequences=k,
                              pad_token_id=pad, **generation)


@pytest.fixture(scope="module", params=["qwen2-tiny", "llama-tiny"])
def model(request, tiny_models):
    return AutoModelForCausalLM.from_pretrained(tiny_models[request.param]).eval()


@pytest.mark.parametrize("generation", SETTINGS)
def test_same_tokens_as_generate_for_the_same_seed(model, generation):
    for seed in range(4):
        prompt = torch.randint(5, 200, (1, 2 + 5 * seed), generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        expected = _generate(model, prompt, 4, generation)
        torch.manual_seed(seed)
        got = lean_sample(model, [prompt], 4, generation, 1)[0]
        assert got is not None
        assert torch.equal(got, expected)


def test_eos_pads_the_rest_and_stops_when_every_sequence_ended(model):
    """Make the tokens every row draws third the EOS ids: each row ends by step 3, some earlier (then
    padded), and the loop stops there instead of running to ``max_new_tokens``."""
    generation = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 3, "max_new_tokens": 40}
    prompt = torch.tensor([[7, 8, 9]])
    torch.manual_seed(0)
    third = sorted(set(_generate(model, prompt, 6, generation)[:, 5].tolist()))
    original = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = third
    try:
        torch.manual_seed(0)
        expected = _generate(model, prompt, 6, generation)
        torch.manual_seed(0)
        got = lean_sample(model, [prompt], 6, generation, 1)[0]
    finally:
        model.generation_config.eos_token_id = original
    assert torch.equal(got, expected)
    assert got.shape[1] == prompt.shape[1] + 3
    assert (got[:, 3:] == 1).any()


def test_steps_aside_for_what_it_does_not_reproduce(model):
    generation = dict(SETTINGS[0])
    prompt = torch.tensor([[5, 6, 7]])
    assert lean_sample(model, [prompt], 2, {**generation, "repetition_penalty": 1.3}, 1) is None
    assert lean_sample(model, [prompt], 2, {**generation, "do_sample": False}, 1) is None
    model.generation_config.no_repeat_ngram_size = 2
    try:
        assert lean_sample(model, [prompt], 2, generation, 1) is None
    finally:
        model.generation_config.no_repeat_ngram_size = None
    hook = model.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    try:
        assert lean_sample(model, [prompt], 2, generation, 1) is None
    finally:
        hook.remove()
    assert lean_sample(model, [prompt], 2, generation, 1) is not None


def test_on_an_amd_cpu_large_weights_are_transposed_or_warmed_and_give_f_linear(monkeypatch):
    """The AMD path (see ``AMD_CPU``), forced here on any CPU: ``weight @ x.T`` for 2-4 rows of a
    weight of 128K elements or more, a sum before ``F.linear`` otherwise from 32K where that pays
    (``READ_FIRST``). Linears side by side, run apart (the CPU) or joined (accelerators), give the
    joined weights' product."""
    from comlrl_core import decoding
    from comlrl_core.decoding import _Projection

    monkeypatch.setattr(decoding, "AMD_CPU", True)
    monkeypatch.setattr(decoding, "READ_FIRST", True)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(384, 640), torch.nn.Linear(384, 128, bias=False)]
    apart, joined = _Projection(layers, join=False), _Projection(layers, join=True)
    assert [(p.transposed, p.warmed) for p in apart.products] == [(True, True), (False, True)]  # 245K, 49K elements
    assert [(p.transposed, p.warmed) for p in joined.products] == [(True, True)]
    small = _Projection([torch.nn.Linear(32, 64)], join=False).products[0]
    assert not small.transposed and not small.warmed
    weight = torch.cat([m.weight for m in layers])
    bias = torch.cat([layers[0].bias, torch.zeros(128)])
    for rows in range(1, 11):
        x = torch.randn(rows, 1, 384)
        expected = torch.nn.functional.linear(x, weight, bias)
        for projection in (apart, joined):
            got = projection(x)
            assert got.shape == (rows, 1, 768) and got.is_contiguous()
            if 2 <= rows <= 4:
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            else:  # warmed: F.linear itself
                assert torch.equal(got, expected)
    monkeypatch.setattr(decoding, "READ_FIRST", False)
    assert [(p.transposed, p.warmed) for p in _Projection(layers, join=False).products] == [(True, False), (False, False)]
    monkeypatch.setattr(decoding, "AMD_CPU", False)
    assert not any(p.transposed or p.warmed for p in _Projection(layers, join=True).products)


def test_same_tokens_as_generate_on_a_model_wide_enough_for_the_amd_path(monkeypatch):
    """The tiny models' weights are too small for the AMD path; this one's layers take it (on every
    CPU here, as on an AMD one): 4 rows transposed, the prefill warmed."""
    from comlrl_core import decoding
    from comlrl_core.tiny_models import TOKENIZERS, TinyModelSpec, build_model, build_tokenizer

    monkeypatch.setattr(decoding, "AMD_CPU", True)
    monkeypatch.setattr(decoding, "READ_FIRST", True)

    spec = TinyModelSpec("qwen2-wide", "qwen2", "shared", 384, 1, 6, 2, 1024)
    model = build_model(spec, build_tokenizer(TOKENIZERS["shared"]), seed=3)
    for seed, generation in enumerate(SETTINGS):
        prompt = torch.randint(5, 200, (1, 4 + seed), generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        expected = _generate(model, prompt, 4, generation)
        torch.manual_seed(seed)
        assert torch.equal(lean_sample(model, [prompt], 4, generation, 1)[0], expected)


def test_the_fixed_shape_step_a_cuda_graph_replays_equals_the_eager_step(model):
    """``_Decoder.step`` (one token per row at a tensor position, attention over the whole cache
    with unwritten positions masked) gives the eager step's logits at every position."""
    from comlrl_core.decoding import _Decoder

    prompt, rows, new = torch.tensor([[5, 6, 7, 8]]), 3, 6
    with torch.inference_mode():
        eager, fixed = (_Decoder(model, rows, prompt.shape[1] + new, prompt.device) for _ in range(2))
        torch.testing.assert_close(eager.logits(prompt, 0), fixed.logits(prompt, 0), rtol=0, atol=0)
        tokens = torch.randint(5, 200, (new, rows, 1), generator=torch.Generator().manual_seed(0))
        for step in range(new):
            position = prompt.shape[1] + step
            torch.testing.assert_close(fixed.step(tokens[step], torch.tensor([position])),
                                       eager.logits(tokens[step], position), rtol=1e-5, atol=1e-5)


def test_the_amd_path_is_chosen_by_the_cpu_vendor_and_reading_first_by_avx512(tmp_path):
    """AMD CPUs take the transposed products, and read weights first only with AVX-512; Intel's, and
    machines whose vendor cannot be read, take neither."""
    from comlrl_core.decoding import _cpu_features

    cases = (("AuthenticAMD", "fpu avx2 avx512f avx512bw", (True, True)), ("AuthenticAMD", "fpu avx2", (True, False)),
             ("AuthenticAMD", "fpu avx2 avx512fp16", (True, False)), ("GenuineIntel", "avx2 avx512f", (False, False)),
             (None, None, (False, False)))
    for n, (vendor, flags, expected) in enumerate(cases):
        info = tmp_path / f"cpuinfo-{n}"
        if vendor is not None:
            info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 25\nflags\t\t: {flags}\n\n"
                            f"processor\t: 1\nvendor_id\t: {vendor}\nflags\t\t: {flags}\n")
        assert _cpu_features(str(info)) == expected


@pytest.mark.parametrize("generation", SETTINGS)
def test_prompts_sampled_together_draw_what_each_draws_alone(model, generation):
    """Prompts of different lengths decode in the same steps, each from its own generator: each gets
    the tokens (and the length, up to its own rows' EOS) that a call of its own draws from that
    seed, and the global generator is left alone."""
    prompts = [torch.randint(5, 200, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 5)]
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = list(range(100, 200))  # rows end early, at different steps
    try:
        alone = [lean_sample(model, [p], 3, generation, 1, [torch.Generator().manual_seed(j)])[0]
                 for j, p in enumerate(prompts)]
        state = torch.get_rng_state()
        together = lean_sample(model, prompts, 3, generation, 1,
                               [torch.Generator().manual_seed(j) for j in range(len(prompts))])
    finally:
        model.generation_config.eos_token_id = eos
    assert torch.equal(torch.get_rng_state(), state)
    for got, expected in zip(together, alone, strict=True):
        assert torch.equal(got, expected)
    new = [got.shape[1] - p.shape[1] for got, p in zip(together, prompts)]
    assert len(set(new)) > 1 or min(new) == generation["max_new_tokens"], new  # some ended early


def test_the_fixed_shape_step_takes_a_position_per_row(model):
    """Rows at different positions (prompts of different lengths side by side) get each row's own
    eager step's logits."""
    from comlrl_core.decoding import _Decoder

    prompts = [torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 10]])]
    with torch.inference_mode():
        alone = [_Decoder(model, 1, 8, p.device) for p in prompts]
        both = _Decoder(model, 2, 8, prompts[0].device)
        for j, p in enumerate(prompts):
            alone[j].logits(p, 0)
            both.logits(p, 0, slice(j, j + 1))
        positions = torch.tensor([4, 2])
        for step, token in enumerate(([20, 21], [30, 31], [40, 41])):
            got = both.step(torch.tensor(token)[:, None], positions + step)
            for j in range(2):
                expected = alone[j].logits(torch.tensor([[token[j]]]), int(positions[j]) + step)
                torch.testing.assert_close(got[j:j + 1], expected, rtol=1e-5, atol=1e-5)


def test_generate_draws_from_each_prompts_generator_where_it_samples(model):
    """Where ``generate`` samples instead (here: an option the lean sampler lacks), prompt j still
    draws from its own generator, and the global generator is left where it was."""
    from comlrl_core.rollout import generate_ids

    generation = {**SETTINGS[0], "repetition_penalty": 1.3}
    prompts = [torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9]])]
    expected = []
    for j, p in enumerate(prompts):
        torch.manual_seed(j)
        expected.append(_generate(model, p, 2, generation))
    state = torch.get_rng_state()
    with torch.inference_mode():
        got = generate_ids(model, prompts, 2, generation, 1, [torch.Generator().manual_seed(j) for j in range(2)])
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
