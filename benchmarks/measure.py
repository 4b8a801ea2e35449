"""What a benchmark case measures, the same way for both implementations.

Imports only torch and transformers (never ``comlrl_core``), so the reference library's runner, in
its own virtual environment, measures with exactly this code.
"""

from __future__ import annotations

import functools
import resource
import sys
import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers.generation.utils import GenerationMixin


class Meter:
    """Counts time and new tokens inside every sampling call, and every optimizer step.

    The sampling function is ``owner.name(model, input_ids, ...)``: Hugging Face ``generate`` by
    default; our runner names its own entry point (a list of prompts in, a list of sequences out),
    which uses ``generate`` only as a fallback.
    """

    def __init__(self, owner=GenerationMixin, name: str = "generate"):
        self.generate_seconds = 0.0
        self.generated_tokens = 0
        self.optimizer_steps = 0
        self._install(owner, name)

    def _install(self, owner, name: str) -> None:
        original = getattr(owner, name)
        meter = self

        @functools.wraps(original)
        def generate(model, *args, **kwargs):
            start = time.perf_counter()
            out = original(model, *args, **kwargs)
            meter.generate_seconds += time.perf_counter() - start
            prompts = kwargs.get("input_ids", args[0] if args else None)
            outs = out if isinstance(out, list) else [out.sequences if hasattr(out, "sequences") else out]
            prompts = prompts if isinstance(prompts, list) else [prompts]  # ours samples several prompts at once
            pad = model.generation_config.pad_token_id
            for prompt, sequences in zip(prompts, outs):
                new = sequences[:, prompt.shape[-1] if isinstance(prompt, torch.Tensor) else 0:]
                meter.generated_tokens += int((new != pad).sum()) if pad is not None else new.numel()
            return out

        setattr(owner, name, generate)
        register_optimizer_step_post_hook(self._count_step)

    def _count_step(self, *args) -> None:
        self.optimizer_steps += 1

    def reset(self) -> None:
        self.generate_seconds, self.generated_tokens, self.optimizer_steps = 0.0, 0, 0


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def setup(threads: int, seed: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)


def result(case: dict, impl: str, meter: Meter, train_seconds: float, items: int, before: float | None,
           after: float | None) -> dict:
    """One JSON line: the case, the implementation and its figures."""
    return {
        "case": case["name"], "impl": impl, "items": items,
        "seconds": round(train_seconds, 3), "s_per_step": round(train_seconds / items, 4),
        "generated_tokens": meter.generated_tokens,
        "generate_tok_s": round(meter.generated_tokens / meter.generate_seconds, 1) if meter.generate_seconds else None,
        "step_tok_s": round(meter.generated_tokens / train_seconds, 1),
        "generate_share": round(meter.generate_seconds / train_seconds, 3),
        "optimizer_steps": meter.optimizer_steps,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "eval_before": before, "eval_after": after,
    }
