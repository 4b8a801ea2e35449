"""A reward/loss curve a person can look at, saved as a PNG next to the run's outputs."""

from __future__ import annotations

from pathlib import Path

LEARNED = "learned/turn_1/reward_mean"  # what a preference trainer's policy is trained on


def plot_history(history: list[dict], path: str | Path, title: str = "") -> Path | None:
    """Training and evaluation task reward (a preference trainer's reward-model score on an axis of its
    own) and the losses against the env step; None when nothing was logged."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot as plt

    series = {
        "train reward": "turn_1/reward_mean",
        "eval reward": "eval/turn_1/reward_mean",
    }
    loss_keys = sorted({k for h in history for k in h if k.endswith("loss")})
    curves = {label: [(h["step"], h[key]) for h in history if key in h] for label, key in series.items()}
    losses = {key: [(h["step"], h[key]) for h in history if key in h] for key in loss_keys}
    learned = [(h["step"], h[LEARNED]) for h in history if LEARNED in h]
    if not any(curves.values()) and not any(losses.values()) and not learned:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for label, points in curves.items():
        if points:
            top.plot(*zip(*points), marker="o" if label.startswith("eval") else None, label=label)
    top.set_ylabel("task reward")
    if any(curves.values()):
        top.legend(loc="upper left")
    if learned:  # the reward model's score has a scale of its own: its own axis
        right = top.twinx()
        right.plot(*zip(*learned), color="tab:purple", alpha=0.6, label="reward-model score (train)")
        right.set_ylabel("reward-model score")
        right.legend(loc="lower right")
    for key, points in losses.items():
        if points:
            bottom.plot(*zip(*points), label=key, alpha=0.8)
    bottom.set_xlabel("env step")
    bottom.set_ylabel("loss")
    if losses:
        bottom.legend(loc="best", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
