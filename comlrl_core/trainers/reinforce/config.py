"""``MAGRPOConfig``: field names and meanings follow the reference library; trap defaults are fixed."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import check_bool, check_choice, check_float, check_int

JOINT_MODES = {"aligned": "aligned", "align": "aligned", "cross": "cross", "crossed": "cross"}
ADVANTAGE_MODES = {"mean": "mean", "raw": "raw", "max": "max", "rloo": "rloo"}


@dataclass
class MAGRPOConfig:
    """Multi-agent group-relative policy optimisation.

    Deliberate differences from the reference: ``num_turns=1`` (2 needs an ``external_transition``),
    ``early_termination_threshold=None`` (the reference's -0.2 ended every rollout after turn one),
    ``discount`` is applied to multi-turn returns, ``num_agents=None`` means "as the trainer
    resolves it", and ``seed``/``shuffle`` make the data order random but reproducible.
    """

    num_train_epochs: int = 20
    agent_learning_rate: float = 5e-6
    num_agents: int | None = None
    num_generations: int = 4
    max_new_tokens: int = 256
    temperature: float = 0.6
    top_p: float = 0.6
    top_k: int | None = 50
    num_turns: int = 1
    discount: float = 1.0
    joint_mode: str = "aligned"
    early_termination_threshold: float | None = None
    external_prompt_passthrough: bool = False
    rollout_buffer_size: int = 2
    train_batch_size: int | None = None
    advantage_normalization: bool = True
    advantage_mode: str = "mean"
    reference_kl_enabled: bool = False
    reference_kl_coef: float = 0.1
    max_grad_norm: float | None = None
    eval_interval: int = 16
    eval_num_samples: int = 4
    logging_steps: int = 1
    seed: int = 0
    shuffle: bool = True
    allow_shared_models: bool = False
    verbose: bool = True

    def __post_init__(self) -> None:
        check_int(self, "num_train_epochs", 1)
        check_float(self, "agent_learning_rate", low=0.0, low_open=True)
        check_int(self, "num_agents", 1, optional=True)
        check_int(self, "num_generations", 2)
        check_int(self, "max_new_tokens", 1)
        check_float(self, "temperature", low=0.0, low_open=True)
        check_float(self, "top_p", low=0.0, high=1.0, low_open=True)
        check_int(self, "top_k", 1, optional=True)
        check_int(self, "num_turns", 1)
        check_float(self, "discount", low=0.0, high=1.0)
        check_choice(self, "joint_mode", JOINT_MODES)
        check_float(self, "early_termination_threshold", optional=True)
        check_int(self, "rollout_buffer_size", 1)
        if self.train_batch_size is None:
            self.train_batch_size = self.rollout_buffer_size
        check_int(self, "train_batch_size", 1)
        check_choice(self, "advantage_mode", ADVANTAGE_MODES)
        check_float(self, "reference_kl_coef", low=0.0)
        check_float(self, "max_grad_norm", low=0.0, low_open=True, optional=True)
        check_int(self, "eval_interval", 0)
        check_int(self, "eval_num_samples", 0)
        check_int(self, "logging_steps", 1)
        check_int(self, "seed", 0)
        for field in ("external_prompt_passthrough", "advantage_normalization", "reference_kl_enabled",
                      "shuffle", "allow_shared_models", "verbose"):
            check_bool(self, field)
