"""Common prefixes run once: how rows are grouped, and that the log-probs and reward scores this
gives equal each row's own full forward (values and gradients)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from comlrl_core.batching import PAYS_FROM, share_prefixes
from comlrl_core.models import CausalLMWithValueHead, JointRewardModel
from comlrl_core.rollout import token_logprobs
from comlrl_core.trainers.actor_critic.base import last_values

SYSTEM = torch.arange(5, 5 + PAYS_FROM["cpu"])  # a shared system prompt: enough tokens to pay when shared twice


def _forward_batches(module):
    """The batch size of every forward call of ``module`` (observed through a hook, not replaced)."""
    seen = []
    module.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs["input_ids"].shape[0]),
                                     with_kwargs=True)
    return seen


def _grads(module):
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return grads


@pytest.fixture
def qwen(tiny_models):
    return AutoModelForCausalLM.from_pretrained(tiny_models["qwen2-tiny"])


def test_rows_group_behind_the_prefixes_that_save_the_most_tokens(qwen):
    """Identical prompts share all but their last token; different prompts share what they have in
    common when that saves more than grouping them apart; a row shares nothing past its limit."""
    a, b = torch.cat([SYSTEM, torch.tensor([300, 301])]), torch.cat([SYSTEM[:10], torch.tensor([400])])
    c = torch.tensor([7, 8, 9])
    shared = share_prefixes(qwen, [a, b, a, c, a], [len(a) - 1, len(b) - 1, len(a) - 1, 2, len(a) - 1], 60)
    assert shared.saved == 2 * (len(a) - 1)  # the three a's; b apart (sharing 10 tokens with them saves less)
    assert shared.lengths == [len(a) - 1, len(b) - 1, len(a) - 1, 2, len(a) - 1]
    assert len(shared.prefixes) == 3 and shared.groups.tolist() == [0, 1, 0, 2, 0]
    # Distinct prompts behind one system prompt: one group, its prefix the system prompt.
    rows = [torch.cat([SYSTEM, torch.tensor([300 + i, 7])]) for i in range(4)]
    shared = share_prefixes(qwen, rows, [len(r) - 1 for r in rows], 60)
    assert shared.saved == 3 * len(SYSTEM) and shared.lengths == [len(SYSTEM)] * 4
    # Limits cap the prefix (the log-prob of a completion's first token needs its last prompt token).
    capped = share_prefixes(qwen, [a, a, a], [20, 20, 20], 60)
    assert capped.lengths == [20, 20, 20] and capped.saved == 40
    # Nothing worth sharing, or a row with nothing to hand over: the full rows run.
    assert share_prefixes(qwen, [a, b[:5]], [len(a) - 1, 4], 60) is None
    assert share_prefixes(qwen, [c, c], [2, 2], 60) is None
    assert share_prefixes(qwen, [a, a, torch.tensor([9])], [len(a) - 1, len(a) - 1, 0], 60) is None


def test_prompts_behind_one_system_prompt_run_it_once_and_score_as_alone(qwen):
    """Different prompts that begin alike (a system prompt) run their common part once, and each
    row's log-probs and gradients still match its own full forward."""
    rows = [(torch.cat([SYSTEM, torch.tensor([300, 301])]), torch.tensor([8, 9, 0]), torch.tensor([True, True, False])),
            (torch.cat([SYSTEM, torch.tensor([400])]), torch.tensor([17, 18, 19, 20]), torch.ones(4, dtype=torch.bool)),
            (torch.cat([SYSTEM, torch.tensor([500, 501, 502])]), torch.tensor([30]), torch.tensor([True]))]
    seen = _forward_batches(qwen)
    weights = torch.tensor([1.0, -2.0, 0.5])
    shared = token_logprobs(qwen, rows)
    (weights * shared.sum(dim=1)).sum().backward()
    assert seen == [1, 3]
    shared_grads = _grads(qwen)
    alone = torch.stack([token_logprobs(qwen, [row])[0].sum() for row in rows])
    (weights * alone).sum().backward()
    torch.testing.assert_close(shared.sum(dim=1), alone, rtol=1e-5, atol=1e-5)
    for together, single in zip(shared_grads, _grads(qwen)):
        torch.testing.assert_close(together, single, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny"])
def test_reward_scores_run_shared_prefixes_and_repeats_once_and_equal_scoring_alone(tiny_models, name):
    """Winners and losers behind their joint prompts, one text twice: the distinct prefixes run once,
    each distinct text's tail once, and every score and gradient equals the text scored alone."""
    torch.manual_seed(0)
    model = JointRewardModel(AutoModelForCausalLM.from_pretrained(tiny_models[name]))
    first, second = torch.cat([SYSTEM, torch.tensor([60, 61])]), torch.cat([SYSTEM[:8], torch.tensor([70])])
    texts = [torch.cat([first, torch.tensor([1, 2, 3])]), torch.cat([first, torch.tensor([4, 5])]),
             torch.cat([second, torch.tensor([6, 7, 8, 9])]), torch.cat([second, torch.tensor([10])]),
             torch.cat([first, torch.tensor([1, 2, 3])])]
    seen = _forward_batches(model.backbone.base_model)
    weights = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0])
    scores = model.score(texts)
    (weights * scores).sum().backward()
    assert seen == [2, 4]
    shared_grads = _grads(model)
    alone = torch.cat([model(t[None], torch.ones(1, len(t), dtype=torch.long)) for t in texts])
    (weights * alone).sum().backward()
    torch.testing.assert_close(scores, alone, rtol=1e-5, atol=1e-5)
    assert scores[0] == scores[4]
    for together, single in zip(shared_grads, _grads(model)):
        torch.testing.assert_close(together, single, rtol=1e-4, atol=1e-6)
    del seen[:]
    with torch.inference_mode():  # how the learned reward scores the policy's samples
        torch.testing.assert_close(model.score(texts), scores.detach())
        model.score(texts[2:4] + texts[2:4])  # too little shared to pay: one forward of the distinct texts
    assert seen == [2, 4, 2]


def test_q_critic_values_run_the_prompt_once_and_equal_each_sequence_alone(tiny_models):
    """A Q-critic reads prompt + completion: its K sequences share the prompt, which runs once, and
    every value and gradient equals the sequence's own forward (the critics' ``last_values``)."""
    torch.manual_seed(0)
    critic = CausalLMWithValueHead(AutoModelForCausalLM.from_pretrained(tiny_models["qwen2-tiny"]),
                                   value_head_hidden_dim=8)
    sequences = [torch.cat([SYSTEM, torch.tensor(tail)]) for tail in ([40, 41], [50], [60, 61, 62], [40, 41])]
    seen = _forward_batches(critic.model.base_model)
    values = last_values(critic, sequences)
    (values * torch.tensor([1.0, -1.0, 2.0, 0.5])).sum().backward()
    assert seen == [1, 3] and values[0] == values[3]
    shared_grads = _grads(critic)
    alone = torch.stack([critic(s[None]).values[0, -1] for s in sequences])
    (alone * torch.tensor([1.0, -1.0, 2.0, 0.5])).sum().backward()
    torch.testing.assert_close(values, alone, rtol=1e-5, atol=1e-5)
    for together, single in zip(shared_grads, _grads(critic)):
        torch.testing.assert_close(together, single, rtol=1e-4, atol=1e-6)



def _final_norm_inputs(reward_model):
    """The shapes the body's final norm is called on (a hook outside the last layer): [B, H] where
    the last layer ran at the scored positions only, [B, L, H] where it ran whole."""
    seen = []
    reward_model.backbone.base_model.norm.register_forward_pre_hook(lambda _, args: seen.append(args[0].dim()))
    return seen


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny", "mistral"])
@pytest.mark.parametrize("prefix", [SYSTEM, SYSTEM[:3]], ids=["shared-prefix", "full-rows"])
def test_the_last_layer_runs_at_the_scored_token_only_and_scores_as_the_full_forward(tiny_models, name, prefix):
    """A scalar head reads one position per row, so the last decoder layer's queries, MLP and final
    norm run there only (its keys and values everywhere): rows of different lengths, behind a
    prefix that runs once or as full right-padded rows, score and train as the full forward."""
    torch.manual_seed(0)
    backbone = (MistralForCausalLM(MistralConfig(vocab_size=505, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 sliding_window=64, tie_word_embeddings=True))
                if name == "mistral" else AutoModelForCausalLM.from_pretrained(tiny_models[name]))
    model = JointRewardModel(backbone)
    texts = [torch.cat([prefix, torch.tensor(tail)]) for tail in ([60, 61, 1, 2], [70], [80, 81, 82])]
    seen = _final_norm_inputs(model)
    weights = torch.tensor([1.0, -1.0, 0.5])
    scores = model.score(texts)
    (weights * scores).sum().backward()
    assert seen == [2]  # one position per row
    apart = _grads(model)
    alone = torch.cat([model(t[None], torch.ones(1, len(t), dtype=torch.long)) for t in texts])
    (weights * alone).sum().backward()
    assert seen == [2, 3, 3, 3]  # ``forward`` runs the whole layer
    torch.testing.assert_close(scores, alone, rtol=1e-5, atol=1e-5)
    for together, single in zip(apart, _grads(model)):
        torch.testing.assert_close(together, single, rtol=1e-4, atol=1e-6)


def test_the_last_layer_runs_whole_where_running_it_apart_is_not_known_exact(tiny_models):
    """Attention dropout in training, or a hook in the last layer (which running it apart would
    bypass): the body's own forward runs, hooks and all."""
    texts = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10])]
    model = JointRewardModel(AutoModelForCausalLM.from_pretrained(tiny_models["llama-tiny"], attention_dropout=0.1))
    seen = _final_norm_inputs(model)
    model.train()
    model.score(texts)  # dropout in the attention
    model.eval()
    model.score(texts)
    assert seen == [3, 2]
    calls = []
    model.backbone.base_model.layers[-1].mlp.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    model.score(texts)
    assert seen == [3, 2, 3] and calls == [(2, 4, model.backbone.config.hidden_size)]
