"""``MARLHFConfig`` and ``MARLHFIterConfig``: reference names; every RL backend's options forwarded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..actor_critic.config import CRITIC_TYPES
from ..config import TrainerConfig, check_bool, check_choice, check_devices, check_float, check_int
from ..reinforce.config import JOINT_MODES

# rl_algorithm -> (backend, advantage_mode for the MAGRPO family)
RL_ALGORITHMS = {
    "magrpo": ("magrpo", "mean"), "mareinforce": ("magrpo", "raw"), "mareforce": ("magrpo", "raw"),
    "maremax": ("magrpo", "max"), "marloo": ("magrpo", "rloo"), "iac": ("iac", None), "maac": ("maac", None),
}
PAIR_SELECTIONS = {"reward_gap": "reward_gap", "all": "all", "random": "random"}


@dataclass
class MARLHFConfig(TrainerConfig):
    """Preference collection, a Bradley-Terry joint reward model, then RL on the learned reward.

    Differences from the reference: ``reward_model_device`` is checked at construction; the
    critic and value-head options reach every backend (MAAC included); ``reward_eval_fraction``
    holds pairs out to report the reward model's accuracy; ``preference_output_dir`` (off by
    default) writes each preference set as JSONL.

    Devices: ``agent_devices``, ``reference_devices`` and ``critic_devices`` go to the RL backend
    (see ``TrainerConfig`` and ``ActorCriticConfig``). ``reward_model_device`` is one device, None
    (agent 0's device) or ``"auto"`` (the CUDA device after the agents', round-robin; the CPU
    without CUDA); whether it exists is checked when the trainer is built.
    """

    rl_algorithm: str = "magrpo"
    joint_mode: str = "aligned"
    top_k: int | None = 50
    preference_num_candidates: int = 80
    preference_pairs_per_sample: int | None = 16
    pair_selection: str = "reward_gap"
    preference_output_dir: str | None = None
    reward_model_name: str | None = None
    reward_model_device: str | None = "cuda:0"
    reward_learning_rate: float = 1e-5
    reward_num_train_epochs: int = 1
    reward_train_batch_size: int = 1
    reward_max_length: int | None = None
    reward_freeze_backbone: bool = False
    reward_eval_fraction: float = 0.0
    critic_model_name: str | None = None
    critic_learning_rate: float | None = None
    critic_devices: str | list[str] | None = None
    use_separate_critic: bool = True
    critic_type: str = "v"
    value_loss_coef: float = 0.6
    value_clip_range: float | None = None
    value_head_hidden_dim: int | None = None
    critic_value_head_hidden_dim: int | None = None

    def __post_init__(self) -> None:
        check_choice(self, "rl_algorithm", {name: name for name in RL_ALGORITHMS})
        self.min_generations = 2 if self.backend == "magrpo" else 1
        super().__post_init__()
        if self.num_turns != 1:
            raise ValueError(f"{type(self).__name__}.num_turns must be 1: preference learning scores one joint turn.")
        check_choice(self, "joint_mode", JOINT_MODES)
        if self.joint_mode != "aligned":
            raise ValueError(f"{type(self).__name__}.joint_mode must be 'aligned': the reward model scores aligned "
                             "joint samples.")
        check_int(self, "preference_num_candidates", 2)
        check_int(self, "preference_pairs_per_sample", 1, optional=True)
        check_choice(self, "pair_selection", PAIR_SELECTIONS)
        if self.pair_selection == "all" and self.preference_pairs_per_sample is not None:
            raise ValueError(f"{type(self).__name__}.preference_pairs_per_sample must be None when "
                             "pair_selection='all'.")
        check_float(self, "reward_learning_rate", low=0.0, low_open=True)
        check_int(self, "reward_num_train_epochs", 1)
        check_int(self, "reward_train_batch_size", 1)
        check_int(self, "reward_max_length", 1, optional=True)
        check_bool(self, "reward_freeze_backbone")
        check_float(self, "reward_eval_fraction", low=0.0, high=0.9)
        check_float(self, "critic_learning_rate", low=0.0, low_open=True, optional=True)
        check_bool(self, "use_separate_critic")
        check_choice(self, "critic_type", CRITIC_TYPES)
        check_float(self, "value_loss_coef", low=0.0, low_open=True)
        check_float(self, "value_clip_range", low=0.0, low_open=True, optional=True)
        check_int(self, "value_head_hidden_dim", 1, optional=True)
        check_int(self, "critic_value_head_hidden_dim", 1, optional=True)
        check_devices(self, "critic_devices")
        if isinstance(self.reward_model_device, torch.device):  # the config is stored as JSON
            self.reward_model_device = str(self.reward_model_device)
        for field in ("reward_model_name", "critic_model_name", "preference_output_dir"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{type(self).__name__}.{field} must be a non-empty string or None.")

    @property
    def backend(self) -> str:
        return RL_ALGORITHMS[self.rl_algorithm][0]


@dataclass
class MARLHFIterConfig(MARLHFConfig):
    """``num_iterations`` rounds of: reload the reward model, collect with the current policy, fit, train."""

    num_iterations: int = 6
    num_train_epochs: int = 2
    preference_num_candidates: int = 20
    preference_pairs_per_sample: int | None = 4
    reward_num_train_epochs: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self, "num_iterations", 1)
