"""Reward functions that fail on purpose, for the pipeline's resume tests (imported by reference)."""

import os
import signal
from collections import Counter

from comlrl_core.environments import length_ratio_reward

_calls: Counter = Counter()


def fail_once(answers, summaries):
    """The length-ratio reward, except that call ``COMLRL_FAULT_AT`` raises (or, with
    ``COMLRL_FAULT_KILL=1``, SIGKILLs the process) once: the marker file records that it happened."""
    marker = os.environ.get("COMLRL_FAULT_MARKER")
    if marker:
        _calls[marker] += 1
        if _calls[marker] == int(os.environ.get("COMLRL_FAULT_AT", "5")) and not os.path.exists(marker):
            open(marker, "w").close()
            if os.environ.get("COMLRL_FAULT_KILL") == "1":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure in the reward function")
    return length_ratio_reward(answers, summaries)
