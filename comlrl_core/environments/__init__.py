"""Cooperative tasks shipped with the project, offline: each a dataset builder, a reward, per-agent
prompt templates and, where it has a multi-turn form, an ``external_transition``.

A run spec names one by ``task:`` (which fills in its data, reward and prompts) or uses its parts
by import string, e.g. ``reward_func: comlrl_core.environments.writing:writing_reward``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..prompts import PromptTemplate
from .coding import CODING_PROMPTS, coding_dataset, coding_reward
from .length_ratio import TOPICS, length_ratio_dataset, length_ratio_reward
from .writing import WRITING_PROMPTS, writing_dataset, writing_reward, writing_transition


@dataclass(frozen=True)
class Task:
    """A shipped task by its import strings (a run spec is JSON, so it refers to code by name)."""

    dataset: str  # builder(split=..., ...) -> list of dict items
    reward: str
    prompts: tuple[PromptTemplate, ...] | None = None  # None: items carry a ready "prompt"
    transition: str | None = None  # the multi-turn form's external_transition


_HERE = __name__
TASKS = {
    "length_ratio": Task(f"{_HERE}.length_ratio:length_ratio_dataset", f"{_HERE}.length_ratio:length_ratio_reward"),
    "writing": Task(f"{_HERE}.writing:writing_dataset", f"{_HERE}.writing:writing_reward", WRITING_PROMPTS,
                    f"{_HERE}.writing:writing_transition"),
    "coding": Task(f"{_HERE}.coding:coding_dataset", f"{_HERE}.coding:coding_reward", CODING_PROMPTS),
}

__all__ = ["CODING_PROMPTS", "TASKS", "TOPICS", "Task", "WRITING_PROMPTS", "coding_dataset", "coding_reward",
           "length_ratio_dataset", "length_ratio_reward", "writing_dataset", "writing_reward", "writing_transition"]


def builtin(name: str) -> Task:
    """The shipped task ``name``; the error lists the others."""
    if name not in TASKS:
        raise ValueError(f"no built-in task {name!r}; the shipped tasks are {sorted(TASKS)}.")
    return TASKS[name]

