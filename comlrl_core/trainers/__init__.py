"""Trainers: MAGRPO (``reinforce``); actor-critic and preference-based trainers build on the same base."""

from .reinforce import MAGRPOConfig, MAGRPOTrainer

__all__ = ["MAGRPOConfig", "MAGRPOTrainer"]
