"""The reward-function calling convention, checked once at construction.

``reward_func(completions_agent_0, ..., completions_agent_{N-1}, *, prompts=..., batch_items=...)``:
agent i's completions (a list with one string per joint sample) go to the i-th positional
parameter not named ``prompts`` or ``batch_items``; those two (the per-agent prompts and
``[dataset item]``) are passed by name, only when the function declares them or takes ``**kwargs``. It returns one float per joint sample (a list, tuple,
tensor or array; a bare number only when there is one joint sample). Functions written for the
reference library's aligned mode fit this convention; unlike it, nothing is retried with fewer
arguments, a NaN or infinite reward raises ``FloatingPointError``, and an exception raised inside
the function keeps its type and gains a note naming ``reward_func`` (or ``reward_processor``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

import torch

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_KEYWORDS = ("prompts", "batch_items")


def _name(func: Callable) -> str:
    return repr(getattr(func, "__qualname__", None) or type(func).__name__)


class RewardFunction:
    """A user reward function bound to the convention, plus the optional per-value ``reward_processor``."""

    def __init__(self, func: Callable, num_agents: int, processor: Callable[[float], float] | None = None):
        if not callable(func):
            raise TypeError(f"reward_func must be a callable, got {type(func).__name__}.")
        if processor is not None and not callable(processor):
            raise TypeError(f"reward_processor must be a callable or None, got {type(processor).__name__}.")
        self.func = func
        self.processor = processor
        self.num_agents = num_agents
        self.keywords, self.by_name = self._check_signature(func, num_agents)

    @staticmethod
    def _check_signature(func: Callable, num_agents: int) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
        """The keywords to pass, and the completion parameters' names when they must be bound by name."""
        try:
            params = list(inspect.signature(func).parameters.values())
        except (TypeError, ValueError):  # builtins without a signature: positional completions only
            return (), None
        has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        keywords = tuple(k for k in _KEYWORDS if has_var_kw or any(
            p.name == k and p.kind is not inspect.Parameter.POSITIONAL_ONLY for p in params))
        positional = [p.name for p in params if p.kind in _POSITIONAL]
        completion_params = [name for name in positional if name not in keywords]
        required = [p for p in params if p.kind in _POSITIONAL and p.name not in keywords
                    and p.default is inspect.Parameter.empty]
        has_var_args = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
        if len(required) > num_agents or (len(completion_params) < num_agents and not has_var_args):
            raise TypeError(
                f"reward_func {getattr(func, '__name__', func)!r} must accept one positional argument per agent "
                f"({num_agents}: the completions of agent 0, agent 1, ...); its signature is "
                f"{inspect.signature(func)}. Take prompts/batch_items as keyword parameters "
                "(e.g. def reward(a, b, *, prompts=None, batch_items=None))."
            )
        # A `prompts` parameter before the completions (reference style) means binding them by name.
        if positional[:num_agents] != completion_params[:num_agents]:
            return keywords, tuple(completion_params[:num_agents])
        return keywords, None

    def __call__(self, completions: Sequence[Sequence[str]], *, prompts: list[str], batch_items: list) -> list[float]:
        """Rewards for ``len(completions[0])`` joint samples; ``completions[i]`` are agent i's texts."""
        count = len(completions[0])
        available = {"prompts": prompts, "batch_items": batch_items}
        keywords = {k: available[k] for k in self.keywords}
        try:
            if self.by_name:
                raw = self.func(**dict(zip(self.by_name, map(list, completions))), **keywords)
            else:
                raw = self.func(*[list(c) for c in completions], **keywords)
        except Exception as exc:
            exc.add_note(f"raised inside reward_func {_name(self.func)} (called with {count} joint samples).")
            raise
        values = self._as_floats(raw, count)
        if self.processor is not None:
            try:
                values = [float(self.processor(v)) for v in values]
            except Exception as exc:
                exc.add_note(f"raised inside reward_processor {_name(self.processor)} (or its result is not a number).")
                raise
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            raise FloatingPointError(f"reward_func/reward_processor returned a non-finite reward ({bad[0]}); "
                                     "rewards must be finite numbers.")
        return values

    def _as_floats(self, raw: object, count: int) -> list[float]:
        if isinstance(raw, torch.Tensor):
            raw = raw.detach().flatten().tolist()
        elif hasattr(raw, "tolist") and not isinstance(raw, (list, tuple)):
            raw = raw.tolist()
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            got = "a single number"
            raw = [raw]
        else:
            got = f"{len(raw)} values" if isinstance(raw, (list, tuple)) else f"a {type(raw).__name__}"
        if not isinstance(raw, (list, tuple)) or len(raw) != count:
            raise ValueError(
                f"reward_func returned {got} for {count} joint samples; return a list with one float per "
                "joint sample (per position of the completion lists)."
            )
        try:
            return [float(v) for v in raw]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"reward_func must return numbers; got {raw!r}.") from exc
