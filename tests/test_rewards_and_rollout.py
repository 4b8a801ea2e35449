"""The reward calling convention, completion masks and log-probs."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl_core.rewards import RewardFunction
from comlrl_core.rollout import completion_mask, sample, token_logprobs
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




def test_each_item_gets_its_share_of_the_sampling_time_and_rates_are_true(tiny_models):
    """Items sampled together split the call's wall time; a trainer's tokens/s is tokens over that time
    (it was once tokens over a near-zero interval for items sampled ahead: 8.8e5 tokens/s on a CPU)."""
    import time

    from comlrl_core.environments import length_ratio_dataset, length_ratio_reward
    from comlrl_core.rollout import ItemDraws, sample_items
    from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2-tiny"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2-tiny"])
    generation = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 8}
    started = time.perf_counter()
    items = sample_items([model, model], [tokenizer, tokenizer], [["a b", "c"], ["d", "e f"], ["g", "h"]], 2,
                         generation, [ItemDraws(n) for n in range(3)])
    elapsed = time.perf_counter() - started
    shares = [c.seconds for item in items for c in item]
    assert all(s > 0 for s in shares) and sum(shares) <= elapsed
    assert items[0][0].seconds == items[2][0].seconds  # one call per agent, split evenly over its items

    trainer = MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], num_agents=2, reward_func=length_ratio_reward,
                            train_dataset=length_ratio_dataset(5),
                            args=MAGRPOConfig(num_agents=2, num_train_epochs=1, num_generations=2, max_new_tokens=8,
                                              rollout_buffer_size=4, eval_interval=0, verbose=False))
    trainer.train()
    steps = [h for h in trainer.history if "generated_tokens_per_second" in h]
    assert len(steps) == 5  # every item: four sampled ahead together, the last in its own step
    # Rates from the calls' own time: the four items' rates and the last one's differ by their token
    # counts and the calls' efficiency only; a near-zero interval made them differ by orders of magnitude.
    rates = [h["generated_tokens_per_second"] for h in steps]
    print(f"tokens/s of the five items: {[round(r) for r in rates]}")
    assert max(rates) <= 100 * min(rates)
    assert len([h for h in trainer.history if "seconds_per_step" in h]) == 2  # once per window
