"""``writing``: agent 0 writes a one-sentence summary of a topic, agent 1 a short paragraph that
elaborates on it. The joint reward comes in levels, each counted only once the one before is met:

1. **bounds**: per agent, 0.25 for a finished text (it ends a sentence: one cut off by the token
   limit is not) and 0.25 for a length within its word bounds;
2. **ratio**: the paragraph is 2-4 times as long as the summary (in words): 1 inside the band,
   falling to 0 at a factor of 2 outside it;
3. **quality**, a third each: vocabulary diversity (distinct words over words in the paragraph, full
   at 0.6), relevance (the share of the topic's content words the summary names, full at 0.5) and
   consistency (the share of the summary's content words the paragraph uses, full at 0.5).

The reward is their sum over 3, in [0, 1]. Words are whitespace-separated, so the reward does not
depend on the agents' tokenizers. The 400 topics are built here deterministically; subjects are
split 80/20, so the eval split asks about subjects training never saw.
"""

from __future__ import annotations

import math
import re

from ..prompts import PromptTemplate

SUMMARY_WORDS = (10, 25)
PARAGRAPH_WORDS = (25, 70)
RATIO_BAND = (2.0, 4.0)
FULL_DIVERSITY = 0.6
FULL_COHERENCE = 0.5

SUBJECTS = (
    "how bees communicate", "why the sky is blue", "the history of the bicycle", "how vaccines work",
    "why leaves change colour", "how a rainbow forms", "the water cycle", "how volcanoes erupt",
    "why we sleep", "how the heart pumps blood", "the invention of the printing press", "how bread rises",
    "why cats purr", "how airplanes stay in the air", "the life cycle of a butterfly", "how tides work",
    "why the moon has phases", "how recycling helps", "the first moon landing", "how solar panels work",
    "why exercise matters", "how a compass works", "the role of bees in farming", "how earthquakes happen",
    "why oceans are salty", "how plants make food", "the history of paper money", "how a battery stores energy",
    "why birds migrate", "how glaciers shape valleys", "the importance of clean water", "how memory works",
    "why stars twinkle", "how a bridge carries weight", "the origins of chess", "how coral reefs grow",
    "why we have seasons", "how a refrigerator keeps food cold", "the discovery of penicillin",
    "how wind turbines make power", "why some animals hibernate", "how the internet sends messages",
    "the history of the telephone", "how a seed becomes a tree", "why rust forms on iron", "how lightning forms",
    "the benefits of reading", "how soap cleans", "why teamwork helps projects", "how maps are made",
    "the history of the Olympic Games", "how clouds form", "why bats use echoes", "how a camera captures light",
    "the importance of forests", "how muscles grow", "why the Earth has a magnetic field", "how cheese is made",
    "the invention of the light bulb", "how rivers carve canyons", "why music moves us", "how a clock keeps time",
    "the role of fungi in nature", "how trains run on rails", "why ice floats", "how languages change",
    "the history of the calendar", "how desert animals survive", "why we yawn", "how a lock and key work",
    "the growth of cities", "how spiders spin webs", "why planets orbit the sun", "how a microwave heats food",
    "the history of writing", "how hurricanes form", "why some foods spoil", "how bicycles balance",
    "the life of a honeybee colony", "how telescopes see far away", "why the ocean has waves",
    "how a thermometer works", "the history of the compass", "how frogs change as they grow",
    "why people save money", "how snowflakes form", "the importance of sleep for students",
    "how submarines dive", "why the Dead Sea is so salty", "how elephants communicate",
    "the history of the bicycle helmet", "how tea is grown", "why volcanoes create islands",
    "how a parachute slows a fall", "the invention of the wheel", "how owls hunt at night",
    "why gardens need worms", "how a kite flies", "the spread of the potato", "how wolves live in packs",
)
AUDIENCES = ("a curious child", "a busy adult", "a school newsletter", "a science blog")

WRITING_PROMPTS = (
    PromptTemplate(user="Write a one-sentence summary of {topic}, for {audience}. Use 10 to 25 words."),
    PromptTemplate(user="Write one short paragraph that explains {topic}, for {audience}. Use 40 to 60 words."),
)

_WORD = re.compile(r"[a-z']+")
_STOP = frozenset("the a an and or but of to in on at for with by from as is are was were be been it its this that "
                  "these those they them their there then than so such can could will would should may might "
                  "into over under about also very more most much many some any each every how why what when "
                  "which who whom whose your you our we us his her she he".split())


def writing_dataset(split: str = "train") -> list[dict]:
    """The task's items, ``{"topic", "audience", "prompt"}``; ``split`` is ``"train"`` (320 items
    from 80 subjects) or ``"eval"`` (80 items from the other 20)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: the writing task has the splits 'train' and 'eval'.")
    subjects = [s for i, s in enumerate(SUBJECTS) if (i % 5 == 4) == (split == "eval")]
    return [{"topic": subject, "audience": audience, "prompt": f"Write about {subject}, for {audience}."}
            for audience in AUDIENCES for subject in subjects]  # a prefix still spans the subjects


def _words(text: str) -> list[str]:
    return text.split()


def _finished(text: str) -> bool:
    """Ends a sentence: a cut-off completion (the token limit reached mid-sentence) is not finished."""
    return text.rstrip().rstrip("\"')]*").endswith((".", "!", "?"))


def _content(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if len(w) > 3 and w not in _STOP}


def _bounds(text: str, bounds: tuple[int, int]) -> float:
    return 0.25 * _finished(text) + 0.25 * (bounds[0] <= len(_words(text)) <= bounds[1])


def _ratio(summary: str, paragraph: str) -> float:
    ratio = len(_words(paragraph)) / len(_words(summary))
    low, high = RATIO_BAND
    if low <= ratio <= high:
        return 1.0
    off = math.log(low / ratio) if ratio < low else math.log(ratio / high)
    return max(0.0, 1.0 - off / math.log(2))


def _covered(key: set[str], text: str) -> float:
    """The share of ``key``'s words that ``text`` uses, full at ``FULL_COHERENCE``."""
    return min(1.0, len(key & _content(text)) / len(key) / FULL_COHERENCE) if key else 0.0


def _quality(summary: str, paragraph: str, topic: str) -> float:
    words = _WORD.findall(paragraph.lower())
    diversity = min(1.0, len(set(words)) / max(len(words), 1) / FULL_DIVERSITY)
    relevance = _covered(_content(topic), summary) if _content(topic) else 1.0  # no content word to name
    return (diversity + relevance + _covered(_content(summary), paragraph)) / 3


def writing_levels(summary: str, paragraph: str, topic: str) -> tuple[float, float, float]:
    """The three levels' scores for one joint sample (a level is 0 until the one before is full)."""
    bounds = _bounds(summary, SUMMARY_WORDS) + _bounds(paragraph, PARAGRAPH_WORDS)
    ratio = _ratio(summary, paragraph) if bounds == 1.0 else 0.0
    quality = _quality(summary, paragraph, topic) if ratio == 1.0 else 0.0
    return bounds, ratio, quality


def writing_reward(summaries: list[str], paragraphs: list[str], *, batch_items: list[dict]) -> list[float]:
    """One reward in [0, 1] per joint sample of the item ``batch_items[0]``: the sum of its levels over 3."""
    topic = batch_items[0]["topic"]
    return [sum(writing_levels(s, p, topic)) / 3 for s, p in zip(summaries, paragraphs)]


def writing_transition(prompt: str, agent_completions: list[str], num_agents: int,
                       prompt_history_per_agent: list[list[str]], response_history_per_agent: list[list[str]]
                       ) -> list[str]:
    """The multi-turn form: each agent revises its text after reading the other's, so the summary
    comes to summarise the paragraph and the paragraph to elaborate on the summary."""
    if num_agents != 2:
        raise ValueError(f"the writing task has two agents (summary, paragraph), got num_agents={num_agents}.")
    summary, paragraph = agent_completions
    return [
        f"Your summary was: \"{summary}\"\nThe paragraph written beside it is: \"{paragraph}\"\n"
        "Rewrite your summary as one sentence of 10 to 25 words that summarises that paragraph.",
        f"Your paragraph was: \"{paragraph}\"\nThe summary written beside it is: \"{summary}\"\n"
        "Rewrite your paragraph in 40 to 60 words so that it elaborates on that summary.",
    ]
