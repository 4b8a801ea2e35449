"""``IACConfig`` and ``MAACConfig``: reference field names; every numeric field validated."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TrainerConfig, check_bool, check_choice, check_devices, check_float, check_int

CRITIC_TYPES = {"v": "v", "q": "q"}


@dataclass
class ActorCriticConfig(TrainerConfig):
    """Fields shared by IAC and MAAC.

    Deliberate differences from the reference: ``num_turns=1`` and
    ``early_termination_threshold=None`` (trap defaults), ``critic_learning_rate=None`` falls back
    to the actor's rate in both trainers, and ``value_clip_range`` is opt-in and applies to every
    critic (the reference clipped only IAC's shared heads).

    ``critic_devices`` places the separate critics like ``agent_devices`` places the agents (one
    entry per critic: per agent for IAC, one for MAAC's central critic). None puts each IAC critic
    on its agent's device and the MAAC critic on agent 0's; it must stay None when
    ``use_separate_critic=False`` (the value heads live on their actors).
    """

    num_train_epochs: int = 40
    num_generations: int = 1
    rollout_buffer_size: int = 8
    critic_learning_rate: float | None = None
    critic_type: str = "v"
    value_loss_coef: float = 0.6
    value_clip_range: float | None = None
    critic_devices: str | list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_turns > 1 and self.num_generations != 1:
            raise ValueError(f"{type(self).__name__}.num_generations must be 1 when num_turns > 1 "
                             f"(multi-turn episodes follow one trajectory), got {self.num_generations}.")
        check_float(self, "critic_learning_rate", low=0.0, low_open=True, optional=True)
        check_choice(self, "critic_type", CRITIC_TYPES)
        check_float(self, "value_loss_coef", low=0.0, low_open=True)
        check_float(self, "value_clip_range", low=0.0, low_open=True, optional=True)
        check_devices(self, "critic_devices")

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
