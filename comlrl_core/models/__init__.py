"""Heads on causal-LM backbones: value heads for critics, the joint reward model."""

from .actor_critic import ActorCriticOutput, CausalLMWithValueHead, ValueHead
from .reward import JointRewardModel

__all__ = ["ActorCriticOutput", "CausalLMWithValueHead", "JointRewardModel", "ValueHead"]
