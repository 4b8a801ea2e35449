"""Value heads, the causal LM with a value head, and the joint reward model."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from comlrl_core.models import CausalLMWithValueHead, JointRewardModel, ValueHead


@pytest.fixture()
def qwen(tiny_models):
    return AutoModelForCausalLM.from_pretrained(tiny_models["qwen2-tiny"])


def test_value_head_layouts_keep_the_seed_state_dict_keys():
    assert sorted(ValueHead(32).state_dict()) == ["value_projection.bias", "value_projection.weight"]
    assert sorted(ValueHead(32, hidden_dim=8).state_dict()) == [
        "pre_projection.0.bias", "pre_projection.0.weight", "value_projection.bias", "value_projection.weight"]
    assert torch.count_nonzero(ValueHead(32).value_projection.bias) == 0
    with pytest.raises(ValueError, match="hidden_dim must be a positive integer"):
        ValueHead(32, hidden_dim=0)


def test_saved_head_of_another_architecture_names_the_config_field(tmp_path):
    path = tmp_path / "value_head.pt"
    torch.save(ValueHead(32, hidden_dim=8).state_dict(), path)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    ValueHead(32, hidden_dim=8).load_state_dict(saved)
    with pytest.raises(ValueError, match="saved head has hidden_dim=8.*critic_value_head_hidden_dim"):
        ValueHead(32).load_state_dict(saved)
    with pytest.raises(ValueError, match="saved head has hidden_dim=None.*value_head_hidden_dim"):
        ValueHead(32, hidden_dim=8).load_state_dict(ValueHead(32).state_dict())


def test_values_are_the_head_on_the_last_hidden_state(qwen):
    wrapper = CausalLMWithValueHead(qwen, value_head_hidden_dim=16)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 1]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    out = wrapper(ids, mask)
    reference = qwen(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert out.values.shape == (2, 4)
    torch.testing.assert_close(out.logits, reference.logits)
    torch.testing.assert_close(out.values, wrapper.value_head(reference.hidden_states[-1]))
    critic_only = wrapper(ids, mask, compute_logits=False)
    assert critic_only.logits is None
    torch.testing.assert_close(critic_only.values, out.values)


def test_actor_without_head_and_generation(qwen):
    wrapper = CausalLMWithValueHead(qwen, attach_value_head=False)
    assert wrapper.value_head is None
    with pytest.raises(ValueError, match="no value head"):
        wrapper(torch.tensor([[5, 6]]))
    assert wrapper.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=2, do_sample=False).shape[1] <= 4


def test_reward_model_scores_the_last_non_padding_token(qwen):
    model = JointRewardModel(qwen)
    alone = model(torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 1]]))
    right = model(torch.tensor([[5, 6, 7, 1, 1], [8, 9, 10, 11, 12]]), torch.tensor([[1, 1, 1, 0, 0], [1] * 5]))
    left = model(torch.tensor([[1, 1, 5, 6, 7]]), torch.tensor([[0, 0, 1, 1, 1]]))
    assert right.shape == (2,)
    torch.testing.assert_close(right[0], alone[0])
    torch.testing.assert_close(left[0], alone[0], atol=1e-5, rtol=1e-4)


def test_frozen_backbone_trains_only_the_head(qwen):
    model = JointRewardModel(qwen, freeze_backbone=True)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["reward_head.weight", "reward_head.bias"]
    model(torch.tensor([[5, 6]]), torch.tensor([[1, 1]])).sum().backward()
    assert model.reward_head.weight.grad is not None
    assert all(p.grad is None for p in qwen.parameters())
