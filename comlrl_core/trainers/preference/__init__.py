"""Preference-based MARL: MARLHF and MARLHFIter with a learned joint reward model."""

from ...models import JointRewardModel
from .config import MARLHFConfig, MARLHFIterConfig
from .marlhf import MARLHFIterTrainer, MARLHFTrainer
from .preferences import PreferenceSet, joint_text

__all__ = ["JointRewardModel", "MARLHFConfig", "MARLHFIterConfig", "MARLHFIterTrainer", "MARLHFTrainer",
           "PreferenceSet", "joint_text"]
