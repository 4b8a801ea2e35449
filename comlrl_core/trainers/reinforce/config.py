"""``MAGRPOConfig``: field names and meanings follow the reference library; trap defaults are fixed."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TrainerConfig, check_choice

JOINT_MODES = {"aligned": "aligned", "align": "aligned", "cross": "cross", "crossed": "cross"}
ADVANTAGE_MODES = {"mean": "mean", "raw": "raw", "max": "max", "rloo": "rloo"}


@dataclass
class MAGRPOConfig(TrainerConfig):
    """Multi-agent group-relative policy optimisation.

    Deliberate differences from the reference: ``num_turns=1`` (2 needs an ``external_transition``),
    ``early_termination_threshold=None`` (the reference's -0.2 ended every rollout after turn one),
    and ``discount`` is applied to multi-turn returns.
    """

    top_k: int | None = 50
    joint_mode: str = "aligned"
    advantage_mode: str = "mean"

    min_generations = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self, "joint_mode", JOINT_MODES)
        check_choice(self, "advantage_mode", ADVANTAGE_MODES)
