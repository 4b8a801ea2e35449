"""Preference pairs: sampled joint candidates, labelled by the task reward, kept as an inspectable dataset."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 1


def joint_text(prompts: list[str], completions: list[str]) -> str:
    """What the joint reward model reads: every agent's prompt and response (1-based agent numbers)."""
    parts = ["Joint multi-agent response"]
    for i, (prompt, completion) in enumerate(zip(prompts, completions), start=1):
        parts.append(f"Agent {i} prompt:\n{prompt}")
        parts.append(f"Agent {i} response:\n{completion}")
    return "\n\n".join(parts)


def select_pairs(rewards: list[float], how: str, limit: int | None) -> list[tuple[int, int]]:
    """Ordered (winner, loser) candidate indices: every strictly better pair (ties dropped), then selected.

    ``reward_gap`` keeps the largest gaps first, ``random`` shuffles (Python's ``random``, which
    checkpoints restore), ``all`` keeps every pair in index order.
    """
    pairs = [(w, l) for w in range(len(rewards)) for l in range(len(rewards)) if rewards[w] > rewards[l]]
    if how == "reward_gap":
        pairs.sort(key=lambda p: (-(rewards[p[0]] - rewards[p[1]]), p))
    elif how == "random":
        random.shuffle(pairs)
    return pairs if limit is None else pairs[:limit]


@dataclass
class PreferenceSet:
    """A versioned list of preference records; ``fingerprint`` identifies its content."""

    records: list[dict]

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_jsonl().encode()).hexdigest()

    def to_jsonl(self) -> str:
        return "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.records)

    def save(self, directory: str | Path, name: str = "preferences") -> Path:
        """Write ``NAME.jsonl`` and ``NAME.meta.json`` (format version, count, fingerprint)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{name}.jsonl"
        path.write_text(self.to_jsonl(), encoding="utf-8")
        meta = {"format": FORMAT_VERSION, "num_pairs": len(self.records), "fingerprint": self.fingerprint}
        (directory / f"{name}.meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> PreferenceSet:
        """Read a saved set back, refusing one whose content no longer matches its fingerprint."""
        path = Path(path)
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
        prefs = cls(records)
        meta_path = path.with_name(path.name.removesuffix(".jsonl") + ".meta.json")
        if meta_path.is_file():
            expected = json.loads(meta_path.read_text())["fingerprint"]
            if expected != prefs.fingerprint:
                raise ValueError(f"{path}: content does not match the fingerprint in {meta_path.name}.")
        return prefs

    def split(self, fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
        """(train, held-out) records. Whole prompts are held out (chosen by a seeded shuffle), so no
        held-out pair shares a prompt or a candidate with a training pair."""
        groups: dict[tuple, list[dict]] = {}
        for record in self.records:
            groups.setdefault((record.get("iteration"), record.get("item")), []).append(record)
        keys = sorted(groups, key=repr)
        random.Random(seed).shuffle(keys)
        held = min(round(len(keys) * fraction), len(keys) - 1)
        train = [r for key in keys[held:] for r in groups[key]]
        return train, [r for key in keys[:held] for r in groups[key]]
