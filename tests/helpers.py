"""Small helpers shared by test modules."""


def reward_rise(history: list[dict], key: str = "turn_1/reward_mean") -> tuple[float, float]:
    """Mean ``key`` over the first and the last quarter of the logged training steps."""
    rewards = [h[key] for h in history if key in h]
    quarter = max(len(rewards) // 4, 1)
    return sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
