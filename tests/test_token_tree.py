"""Rows run as a prefix tree: how the tree is laid out, and that the log-probs, reward scores and
values it gives equal each row's own forward (values and gradients), with the model's own forward
wherever the tree is not known exact."""

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from comlrl_core import token_tree
from comlrl_core.models import CausalLMWithValueHead, JointRewardModel
from comlrl_core.rollout import token_logprobs
from comlrl_core.trainers.actor_critic.base import last_values

SYSTEM = torch.arange(5, 25)  # a system prompt many rows begin with


def _model(tiny_models, name, **overrides):
    if name == "mistral":
        torch.manual_seed(0)
        return MistralForCausalLM(MistralConfig(vocab_size=505, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2,
                                                tie_word_embeddings=True, **{"sliding_window": 64, **overrides}))
    return AutoModelForCausalLM.from_pretrained(tiny_models[name], **overrides)


def _grads(module):
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return grads


def _own_logprobs(model, prompt, completion, mask):
    """A row's completion log-probs from the model's own forward on that row alone (masked-out
    completion tokens masked out of attention, as in a padded batch)."""
    present = torch.cat([torch.ones_like(prompt), mask.long()])[None]
    logits = model(input_ids=torch.cat([prompt, completion])[None], attention_mask=present).logits[0].float()
    picked = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1).gather(-1, completion[:, None]).squeeze(-1)
    return picked * mask


def _mlp_rows(model):
    """How many rows each decoder layer's MLP runs on (its forward wrapped, so no hook is added)."""
    seen = {i: [] for i in range(len(model.model.layers))}
    for i, layer in enumerate(model.model.layers):
        forward = layer.mlp.forward
        layer.mlp.forward = lambda x, forward=forward, i=i: (seen[i].append(x.shape[:-1].numel()), forward(x))[1]
    return seen


def test_the_tree_holds_each_distinct_token_once_and_every_row_along_its_path():
    rows = [torch.cat([SYSTEM, torch.tensor([1, 2])]), torch.cat([SYSTEM, torch.tensor([1, 3, 4])]),
            torch.cat([SYSTEM, torch.tensor([1, 2])]), SYSTEM[:5], torch.tensor([9, 8])]
    tree = token_tree.build(rows)
    assert len(tree.ids) == len(SYSTEM) + 1 + 1 + 2 + 2  # the system prompt, 1, 2, (3, 4), (9, 8)
    for r, row in enumerate(rows):
        path = tree.paths[r, :len(row)]
        assert torch.equal(tree.ids[path], row) and torch.equal(tree.positions[path], torch.arange(len(row)))
    assert torch.equal(tree.paths[0], tree.paths[2])  # a repeated row adds nothing
    # Every node is added by exactly one row: ``slots`` reads each back from that row's path, in node order.
    assert torch.equal(tree.paths.flatten()[tree.slots], torch.arange(len(tree.ids)))
    assert not any(2 * tree.paths.shape[1] <= s < 3 * tree.paths.shape[1] for s in tree.slots.tolist())  # row 2 adds nothing
    nodes, positions = tree.reads(tree.lengths - 2, 3)
    assert positions[3].tolist() == [3, 4, -1] and torch.equal(nodes[3, :2], tree.paths[3, 3:5])
    with pytest.raises(ValueError, match="at least one token"):
        token_tree.build([torch.tensor([1]), torch.tensor([], dtype=torch.long)])


@pytest.mark.parametrize("name", ["qwen2-tiny", "llama-tiny", "mistral"])
def test_log_probs_run_each_distinct_token_once_and_equal_each_row_alone(tiny_models, name):
    """A sample's K completions share its prompt, prompts share a system prompt, a row repeats: the
    layers run each distinct token once (completions up to their EOS mask only, the last layer at the
    read positions only), and each row's log-probs and gradients equal its own forward."""
    model = _model(tiny_models, name)
    a, b = torch.cat([SYSTEM, torch.tensor([300, 301])]), torch.cat([SYSTEM, torch.tensor([400])])
    rows = [(a, torch.tensor([8, 9, 0, 1]), torch.tensor([True, True, True, False])),
            (b, torch.tensor([17, 18, 19]), torch.tensor([True, True, True])),
            (a, torch.tensor([40, 41, 42, 43, 44, 45]), torch.ones(6, dtype=torch.bool)),
            (a, torch.tensor([8, 9, 0, 1]), torch.tensor([True, True, True, False])),
            (torch.tensor([30]), torch.tensor([50]), torch.tensor([True]))]
    seen = _mlp_rows(model)
    tree = token_logprobs(model, rows)
    # Fed: the prompts once (the system prompt, 300 301, 400, 30) and each completion but its last
    # kept token: (8, 9), (17, 18), (40..44), nothing for the one-token completion.
    distinct = len(SYSTEM) + 2 + 1 + 1 + 2 + 2 + 5
    assert seen[0] == [distinct] and seen[len(seen) - 1] == [5 * 6] and tree.shape == (5, 6)
    with torch.inference_mode():  # as the reference KL runs it
        torch.testing.assert_close(token_logprobs(model, rows), tree.detach())
    weights = torch.linspace(-1.0, 2.0, 5)
    (weights * tree.sum(dim=1)).sum().backward()
    tree_grads = _grads(model)
    alone = torch.stack([torch.nn.functional.pad(_own_logprobs(model, *row), (0, 6 - len(row[1]))) for row in rows])
    (weights * alone.sum(dim=1)).sum().backward()
    torch.testing.assert_close(tree, alone, rtol=1e-5, atol=1e-5)
    assert (tree[0, 3:] == 0).all()
    for together, single in zip(tree_grads, _grads(model)):
        torch.testing.assert_close(together, single, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny", "mistral"])
def test_reward_scores_run_shared_prefixes_and_repeats_once_and_equal_scoring_alone(tiny_models, name):
    """Winners and losers behind their joint prompts, one text twice: each distinct token runs once,
    the last layer at each text's last token only, and every score and gradient equals the text
    scored alone."""
    torch.manual_seed(0)
    model = JointRewardModel(_model(tiny_models, name))
    first, second = torch.cat([SYSTEM, torch.tensor([60, 61])]), torch.cat([SYSTEM[:8], torch.tensor([70])])
    texts = [torch.cat([first, torch.tensor([1, 2, 3])]), torch.cat([first, torch.tensor([4, 5])]),
             torch.cat([second, torch.tensor([6, 7, 8, 9])]), torch.cat([second, torch.tensor([10])]),
             torch.cat([first, torch.tensor([1, 2, 3])])]
    seen = _mlp_rows(model.backbone)
    weights = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0])
    scores = model.score(texts)
    (weights * scores).sum().backward()
    assert seen[0] == [len(SYSTEM) + 2 + 3 + 2 + 1 + 4 + 1] and seen[len(seen) - 1] == [4]  # 4 distinct texts
    tree_grads = _grads(model)
    alone = torch.cat([model(t[None], torch.ones(1, len(t), dtype=torch.long)) for t in texts])
    (weights * alone).sum().backward()
    torch.testing.assert_close(scores, alone, rtol=1e-5, atol=1e-5)
    assert scores[0] == scores[4]
    for together, single in zip(tree_grads, _grads(model)):
        torch.testing.assert_close(together, single, rtol=1e-4, atol=1e-6)
    with torch.inference_mode():  # how the learned reward scores the policy's samples
        torch.testing.assert_close(model.score(texts), scores.detach())


def test_q_critic_values_run_the_prompt_once_and_equal_each_sequence_alone(tiny_models):
    """A Q-critic reads prompt + completion: its K sequences share the prompt, which runs once, and
    every value and gradient equals the sequence's own forward (the critics' ``last_values``)."""
    torch.manual_seed(0)
    critic = CausalLMWithValueHead(AutoModelForCausalLM.from_pretrained(tiny_models["qwen2-tiny"]),
                                   value_head_hidden_dim=8)
    sequences = [torch.cat([SYSTEM, torch.tensor(tail)]) for tail in ([40, 41], [50], [60, 61, 62], [40, 41])]
    seen = _mlp_rows(critic.model)
    values = last_values(critic, sequences)
    (values * torch.tensor([1.0, -1.0, 2.0, 0.5])).sum().backward()
    assert seen[0] == [len(SYSTEM) + 2 + 1 + 3] and values[0] == values[3]
    tree_grads = _grads(critic)
    alone = torch.stack([critic(s[None]).values[0, -1] for s in sequences])
    (alone * torch.tensor([1.0, -1.0, 2.0, 0.5])).sum().backward()
    torch.testing.assert_close(values, alone, rtol=1e-5, atol=1e-5)
    for together, single in zip(tree_grads, _grads(critic)):
        torch.testing.assert_close(together, single, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", ["plain", "hook", "backward hook", "dropout in training", "gradient checkpointing",
                                  "short window", "mask with a hole"])
def test_the_model_runs_its_own_forward_where_the_tree_is_not_known_exact(tiny_models, case):
    """A hook the tree would bypass (forward or backward), attention dropout in training, gradient
    checkpointing, a sliding window shorter than the rows, a completion mask with a hole: one
    right-padded forward of the full rows (of different prompt and completion lengths), whose
    log-probs equal each row alone. A plain model runs the tree, not its own forward."""
    model = _model(tiny_models, "mistral", sliding_window=len(SYSTEM)) if case == "short window" else \
        _model(tiny_models, "llama-tiny", attention_dropout=0.1 if case == "dropout in training" else 0.0)
    rows = [(SYSTEM, torch.tensor([6, 7, 8]), torch.tensor([True, case != "mask with a hole", True])),
            (SYSTEM[:7], torch.tensor([9, 10, 11, 12, 0]), torch.tensor([True, True, True, True, False])),
            (torch.tensor([20]), torch.tensor([21]), torch.tensor([True]))]
    if case == "gradient checkpointing":
        model.activation_checkpointing_enable()
        model.train()
    if case == "dropout in training":
        model.train()
    if case == "hook":
        model.model.layers[0].register_forward_pre_hook(lambda *_: None)
    if case == "backward hook":
        model.model.layers[0].register_full_backward_hook(lambda *_: None)
    seen, forward = [], model.forward  # observed by wrapping, since a hook would itself turn the tree off
    model.forward = lambda **kwargs: (seen.append(tuple(kwargs["input_ids"].shape)), forward(**kwargs))[1]
    together = token_logprobs(model, rows)
    # The last position is read by no log-prob.
    assert seen == ([] if case == "plain" else [(3, len(SYSTEM) + 2)])
    if case == "dropout in training":
        return  # random: nothing to compare
    alone = torch.stack([torch.nn.functional.pad(_own_logprobs(model, *row), (0, 5 - len(row[1]))) for row in rows])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
