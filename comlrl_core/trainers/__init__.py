"""Trainers: MAGRPO (``reinforce``), IAC and MAAC (``actor_critic``), all on one shared base."""

from .actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from .reinforce import MAGRPOConfig, MAGRPOTrainer

__all__ = ["IACConfig", "IACTrainer", "MAACConfig", "MAACTrainer", "MAGRPOConfig", "MAGRPOTrainer"]
