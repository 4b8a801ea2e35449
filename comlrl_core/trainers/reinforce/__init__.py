"""Policy-gradient trainers with group-relative baselines."""

from .config import MAGRPOConfig
from .magrpo import MAGRPOTrainer

__all__ = ["MAGRPOConfig", "MAGRPOTrainer"]
