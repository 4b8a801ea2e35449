"""``IACConfig`` and ``MAACConfig``: reference field names; every numeric field validated."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import check_bool, check_choice, check_float, check_int

CRITIC_TYPES = {"v": "v", "q": "q"}


@dataclass
class ActorCriticConfig:
    """Fields shared by IAC and MAAC.

    Deliberate differences from the reference: ``num_turns=1`` and
    ``early_termination_threshold=None`` (trap defaults), ``critic_learning_rate=None`` falls back
    to the actor's rate in both trainers, ``value_clip_range`` is opt-in and applies to every
    critic, and ``seed``/``shuffle`` make the data order random but reproducible.
    """

    num_train_epochs: int = 40
    agent_learning_rate: float = 5e-6
    critic_learning_rate: float | None = None
    num_agents: int | None = None
    num_generations: int = 1
    max_new_tokens: int = 256
    temperature: float = 0.6
    top_p: float = 0.6
    top_k: int | None = None
    num_turns: int = 1
    discount: float = 1.0
    critic_type: str = "v"
    value_loss_coef: float = 0.6
    value_clip_range: float | None = None
    rollout_buffer_size: int = 8
    train_batch_size: int | None = None
    advantage_normalization: bool = True
    early_termination_threshold: float | None = None
    external_prompt_passthrough: bool = False
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
        check_float(self, "critic_learning_rate", low=0.0, low_open=True, optional=True)
        check_int(self, "num_agents", 1, optional=True)
        check_int(self, "num_generations", 1)
        check_int(self, "max_new_tokens", 1)
        check_float(self, "temperature", low=0.0, low_open=True)
        check_float(self, "top_p", low=0.0, high=1.0, low_open=True)
        check_int(self, "top_k", 1, optional=True)
        check_int(self, "num_turns", 1)
        if self.num_turns > 1 and self.num_generations != 1:
            raise ValueError(f"{type(self).__name__}.num_generations must be 1 when num_turns > 1 "
                             f"(multi-turn episodes follow one trajectory), got {self.num_generations}.")
        check_float(self, "discount", low=0.0, high=1.0)
        check_choice(self, "critic_type", CRITIC_TYPES)
        check_float(self, "value_loss_coef", low=0.0, low_open=True)
        check_float(self, "value_clip_range", low=0.0, low_open=True, optional=True)
        check_int(self, "rollout_buffer_size", 1)
        if self.train_batch_size is None:
            self.train_batch_size = self.rollout_buffer_size
        check_int(self, "train_batch_size", 1)
        check_float(self, "early_termination_threshold", optional=True)
        check_float(self, "reference_kl_coef", low=0.0)
        check_float(self, "max_grad_norm", low=0.0, low_open=True, optional=True)
        check_int(self, "eval_interval", 0)
        check_int(self, "eval_num_samples", 0)
        check_int(self, "logging_steps", 1)
        check_int(self, "seed", 0)
        for field in ("advantage_normalization", "external_prompt_passthrough", "reference_kl_enabled",
                      "shuffle", "allow_shared_models", "verbose"):
            check_bool(self, field)

    @property
    def critic_lr(self) -> float:
        return self.critic_learning_rate if self.critic_learning_rate is not None else self.agent_learning_rate


@dataclass
class IACConfig(ActorCriticConfig):
    """Independent actor-critic: a separate critic per agent, or a value head on each actor."""

    use_separate_critic: bool = True
    value_head_hidden_dim: int | None = None
    critic_value_head_hidden_dim: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool(self, "use_separate_critic")
        check_int(self, "value_head_hidden_dim", 1, optional=True)
        check_int(self, "critic_value_head_hidden_dim", 1, optional=True)


@dataclass
class MAACConfig(ActorCriticConfig):
    """Multi-agent actor-critic with one centralised critic (its head width comes from ``model_config``)."""
