"""The reward calling convention, completion masks and log-probs."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, MistralConfig, MistralForCausalLM

from comlrl_core import batching
from comlrl_core.rewards import RewardFunction
from comlrl_core.rollout import actor_batch, completion_logprobs, completion_mask, sample, token_logprobs
from comlrl_core.trainers.reinforce.magrpo import group_advantages

TEXTS = [["a", "bb"], ["ccc", "d"]]


def call(func, n=2, processor=None):
    return RewardFunction(func, n, processor)(TEXTS, prompts=["p0", "p1"], batch_items=[{"prompt": "x"}])


def test_completions_are_positional_and_keywords_only_when_declared():
    seen = {}

    def with_keywords(a, b, *, prompts=None, batch_items=None):
        seen.update(a=a, b=b, prompts=prompts, batch_items=batch_items)
        return [1.0, 2.0]

    assert call(with_keywords) == [1.0, 2.0]
    assert seen == {"a": ["a", "bb"], "b": ["ccc", "d"], "prompts": ["p0", "p1"], "batch_items": [{"prompt": "x"}]}
    # The reference loses batch_items for this signature; here it is passed by keyword.
    assert call(lambda a, b, batch_items=None: [len(batch_items), 0]) == [1.0, 0.0]
    assert call(lambda *cs, **kw: [len(cs), len(kw)]) == [2.0, 2.0]
    assert call(lambda a, b: [0, 0]) == [0.0, 0.0]
    # A reference-style `prompts` first parameter is bound by name, not by position.
    assert call(lambda prompts, a, b: [len(prompts[0]), len(a)]) == [2.0, 2.0]


def test_signature_that_does_not_fit_is_refused_at_construction():
    with pytest.raises(TypeError, match="one positional argument per agent"):
        RewardFunction(lambda x, a, b: [0.0], 2)
    with pytest.raises(TypeError, match="one positional argument per agent"):
        RewardFunction(lambda a: [0.0], 2)
    with pytest.raises(TypeError, match="reward_func must be a callable"):
        RewardFunction("not callable", 2)


def test_wrong_shapes_and_non_finite_rewards_raise():
    with pytest.raises(ValueError, match="returned 1 values for 2 joint samples"):
        call(lambda a, b: [1.0])
    with pytest.raises(ValueError, match="returned a single number for 2 joint samples"):
        call(lambda a, b: 1.0)
    with pytest.raises(ValueError, match="must return numbers"):
        call(lambda a, b: ["x", "y"])
    with pytest.raises(FloatingPointError, match="non-finite reward"):
        call(lambda a, b: [math.nan, 0.0])
    with pytest.raises(FloatingPointError, match="non-finite reward"):
        call(lambda a, b: [1.0, 0.0], processor=lambda r: r * math.inf)
    assert call(lambda a, b: torch.tensor([1.0, 2.0]), processor=lambda r: 2 * r) == [2.0, 4.0]


def test_errors_inside_the_reward_function_are_not_retried():
    calls = []

    def broken(a, b, *, batch_items=None):
        calls.append(1)
        raise TypeError("bug inside the reward")

    with pytest.raises(TypeError, match="bug inside the reward"):
        call(broken)
    assert len(calls) == 1


def test_mask_stops_after_the_first_eos():
    ids = torch.tensor([[5, 6, 0, 1, 1], [5, 0, 0, 0, 0], [7, 8, 9, 10, 11]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(completion_mask(ids, {0}), expected)


def test_logprobs_exclude_padding_and_prompt(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2-tiny"])
    prompt = torch.tensor([5, 6, 7])
    completion = torch.tensor([[8, 9, 0, 1, 1]])
    mask = completion_mask(completion, {0})
    got = token_logprobs(model, [(prompt, completion[0], mask[0])]).sum(dim=1)
    logits = model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 0]])).logits[0].log_softmax(-1)
    manual = logits[2, 8] + logits[3, 9] + logits[4, 0]
    torch.testing.assert_close(got[0], manual)


def test_sample_returns_k_completions_from_one_call(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2-tiny"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2-tiny"])
    torch.manual_seed(0)
    out = sample(model, tokenizer, "Write about cats:", 4, {"do_sample": True, "max_new_tokens": 6})
    assert out.completion_ids.shape[0] == 4 and out.completion_ids.shape[1] <= 6
    assert out.prompt_ids.tolist() == tokenizer("Write about cats:").input_ids
    assert len(out.texts) == 4 and not out.completion_ids.is_inference()


def test_sampling_runs_without_dropout_and_leaves_each_module_in_its_mode(tiny_models):
    """Every module is in eval mode while sampling, and afterwards each is back in its own mode (a
    submodule the user put in eval mode stays there); ``train()`` is never called, since on a model
    loaded with hub kernels each call re-kernelizes it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2-tiny"]).train()
    model.model.layers[0].eval()
    before = {name: m.training for name, m in model.named_modules()}
    model.train = model.eval = lambda *args: pytest.fail("sampling switched modes through train()/eval()")
    seen = []
    model.model.norm.register_forward_pre_hook(lambda *_: seen.append(any(m.training for m in model.modules())))
    sample(model, AutoTokenizer.from_pretrained(tiny_models["qwen2-tiny"]), "Write about cats:", 2,
           {"do_sample": True, "max_new_tokens": 3})
    assert seen and not any(seen)
    assert {name: m.training for name, m in model.named_modules()} == before and not before["model.layers.0"]


def test_advantage_modes_stay_distinct_under_normalisation():
    returns = [1.0, 2.0, 4.0]
    modes = {m: group_advantages(returns, m, True) for m in ("mean", "raw", "max", "rloo")}
    assert len({tuple(v.tolist()) for v in modes.values()}) == 4
    torch.testing.assert_close(modes["mean"].sum(), torch.tensor(0.0))
    assert torch.equal(group_advantages([3.0, 3.0], "raw", True), torch.tensor([3.0, 3.0]))


def test_padded_batch_rows_score_as_they_do_alone(tiny_models):
    """Rows with different prompt and completion lengths in one right-padded forward: each row's
    log-probs and gradients match its own forward (what the MAGRPO and actor-critic updates rely on)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama-tiny"])
    rows = [(torch.tensor([5, 6, 7]), torch.tensor([8, 9, 0, 1]), torch.tensor([True, True, True, False])),
            (torch.tensor([11, 12, 13, 14, 15, 16]), torch.tensor([17, 18]), torch.tensor([True, True])),
            (torch.tensor([20]), torch.tensor([21, 22, 23, 24, 25]), torch.ones(5, dtype=torch.bool))]
    batch = actor_batch(rows)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    together = completion_logprobs(logits, batch).sum(dim=1)
    together.sum().backward()
    batched_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = torch.stack([token_logprobs(model, [row])[0].sum() for row in rows])
    alone.sum().backward()
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    for batched, single in zip(batched_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(batched, single, rtol=1e-4, atol=1e-6)


def _forward_batches(model):
    """The batch size of every forward call of ``model`` (observed through a hook, not replaced)."""
    seen = []
    model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)
    return seen


def _shared_prompt(extra: int = 0) -> torch.Tensor:
    """A prompt long enough that two rows sharing it pass the CPU's sharing threshold."""
    return torch.arange(5, 6 + batching.PAYS_FROM["cpu"] + extra)


def _mistral(sliding_window: int) -> MistralForCausalLM:
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            sliding_window=sliding_window))


@pytest.mark.parametrize("name", ["qwen2-tiny", "llama-tiny", "mistral"])
def test_rows_sharing_a_prompt_run_it_once_and_score_as_they_do_alone(tiny_models, name):
    """A sample's K completions share its prompt: the prompts run once (one forward of the distinct
    prompts, one of the completions on their cache) and each row's log-probs and gradients still
    match its own full forward, whatever the prompt lengths, completion widths and EOS masks
    (Mistral: with a sliding window longer than the rows)."""
    model = _mistral(64) if name == "mistral" else AutoModelForCausalLM.from_pretrained(tiny_models[name])
    a, b, c = _shared_prompt(3), torch.tensor([11, 12]), torch.tensor([30, 31, 32])
    rows = [(a, torch.tensor([8, 9, 0, 1]), torch.tensor([True, True, True, False])),
            (b, torch.tensor([17, 18, 19]), torch.tensor([True, True, True])),
            (a, torch.tensor([40, 41, 42, 43, 44, 45]), torch.ones(6, dtype=torch.bool)),
            (a, torch.tensor([0, 1]), torch.tensor([True, False])),
            (b, torch.tensor([50]), torch.tensor([True])),
            (c, torch.tensor([60, 61]), torch.tensor([True, True]))]
    seen = _forward_batches(model)
    shared = token_logprobs(model, rows)
    assert seen == [3, 6] and shared.shape == (6, 6)
    with torch.inference_mode():  # as the reference KL runs it
        torch.testing.assert_close(token_logprobs(model, rows), shared.detach())
    del seen[2:]
    weights = torch.linspace(-1.0, 2.0, 6)
    (weights * shared.sum(dim=1)).sum().backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = torch.stack([token_logprobs(model, [row])[0].sum() for row in rows])
    assert seen[2:] == [1] * 6
    (weights * alone).sum().backward()
    torch.testing.assert_close(shared.sum(dim=1), alone, rtol=1e-5, atol=1e-5)
    assert (shared[3, 1:] == 0).all() and (shared[4, 1:] == 0).all()
    for together, single in zip(shared_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(together, single, rtol=1e-4, atol=1e-6)


def test_prompts_are_shared_only_where_it_pays_and_equals_the_full_forward(tiny_models):
    """Too few prompt tokens saved to pay for a second pass, one-token prompts, a sliding window
    shorter than the rows and gradient checkpointing (which turns the cache off) take one forward of
    the full rows."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2-tiny"])
    seen = _forward_batches(model)
    completion, keep = torch.tensor([6, 7]), torch.tensor([True, True])
    long, short, one = _shared_prompt(), _shared_prompt(-2), torch.tensor([5])
    token_logprobs(model, [(long, completion, keep)] * 2)
    token_logprobs(model, [(short, completion, keep)] * 2)
    token_logprobs(model, [(one, completion, keep)] * 40)
    windowed = _mistral(len(long) + 1)  # shorter than prompt + completion
    seen_windowed = _forward_batches(windowed)
    token_logprobs(windowed, [(long, completion, keep)] * 2)
    assert seen_windowed == [2]
    model.activation_checkpointing_enable()
    model.train()
    token_logprobs(model, [(long, completion, keep)] * 2)
    assert seen == [1, 2, 2, 40, 2]
