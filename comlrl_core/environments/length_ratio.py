"""``length_ratio``, the toy task for demos and tests: agent 0 writes an answer and agent 1 a summary
about half as long; both are rewarded for the ratio and for brevity. Tiny random-weight models learn
it in seconds on a CPU (they learn when to emit EOS), a quick end-to-end check that training works.
"""

from __future__ import annotations

TOPICS = ("cats", "dogs", "code", "agents", "plans", "tests", "music", "rivers", "stars", "trains", "bread", "chess")


def length_ratio_dataset(size: int = 6, offset: int = 0) -> list[dict]:
    """``size`` prompts ``{"prompt": ..., "topic": ...}``; ``offset`` selects other topics for evaluation."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive integer, got {size!r}.")
    return [{"prompt": f"Write about {TOPICS[(offset + i) % len(TOPICS)]}:",
             "topic": TOPICS[(offset + i) % len(TOPICS)]} for i in range(size)]


def length_ratio_reward(answers: list[str], summaries: list[str]) -> list[float]:
    """1 when the summary is half the answer's length, minus a brevity cost; one value per joint sample."""
    rewards = []
    for answer, summary in zip(answers, summaries):
        ratio_error = abs(len(summary) - 0.5 * len(answer)) / (1 + len(answer) + len(summary))
        rewards.append(1.0 - ratio_error - (len(answer) + len(summary)) / 100)
    return rewards
