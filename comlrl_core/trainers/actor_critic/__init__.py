"""Actor-critic trainers with LLM critics: IAC (independent) and MAAC (centralised critic)."""

from .base import ActorCriticTrainerBase
from .config import IACConfig, MAACConfig
from .iac import IACTrainer
from .maac import MAACTrainer

__all__ = ["ActorCriticTrainerBase", "IACConfig", "IACTrainer", "MAACConfig", "MAACTrainer"]
