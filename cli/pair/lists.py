"""Needle lists: long clips whose answers are read token by token from a few brief events.

The needle-in-a-haystack clips of `hippo.cli.pair.niah` (a drifting textured background, grey
distractors circling the whole clip, K = 6 coloured needles on screen for one second each, needle
i at depth i / 5 of the clip, jittered within its slot), asked for one attribute of every needle, in
temporal order, with no template: each answer is 6 words and a full stop. The count is fixed so that
answer word i looks up the needle in time slot i: with 6-8 needles a clip's count had to be read
too, and the small target lost its place in the list (it answered 6 words for 7 or 8 needles).

    what happens ?           -> red blue blue yellow green red .         (colours)
    what objects ?           -> circle square circle triangle ...        (shapes)
    where ?                  -> top middle middle bottom ...             (row at the middle of its second)
    where does the object go ? -> left up down right ...                   (direction)

Every word but the full stop names what one needle shows, so a model that does not see the video
guesses it (1 in 3 or 4). The needles are drawn large
(never the niah task's small ones) and move slowly, so that a tiny vision encoder sees each one's
colour and shape. `QUESTIONS` are the four questions `hippo bench --long` asks of one prepared video.
Everything is a pure function of (seed, config, question), like the other tasks.
"""

from __future__ import annotations

import random
from dataclasses import replace

from hippo.cli.pair.narration import ROWS
from hippo.cli.pair.niah import NiahConfig, NiahSample, niah_sample
from hippo.cli.pair.task import COLOURS, MOTIONS, SHAPES

#: question -> the attribute its answer lists, one word per needle in temporal order
QUESTIONS = {
    "what happens ?": "colour",
    "what objects ?": "shape",
    "where ?": "row",
    "where does the object go ?": "direction",
}
MAIN = "what happens ?"
#: how often training batches ask each question (the colours are the headline task)
WEIGHTS = {
    "what happens ?": 0.55,
    "what objects ?": 0.15,
    "where ?": 0.15,
    "where does the object go ?": 0.15,
}
#: the needles' look: large and slow (radius in px, speed in px per frame), never small
LOOK = {"small": 0.0, "radius": (11.0, 14.0), "speed": (2.0, 3.0), "needles": (6, 6)}


def lists_config(cfg: NiahConfig | None = None) -> NiahConfig:
    return replace(cfg or NiahConfig(), **LOOK)


def word(needle, attribute: str) -> str:
    o = needle.obj
    if attribute == "colour":
        return COLOURS[o.colour]
    if attribute == "shape":
        return SHAPES[o.shape]
    if attribute == "row":
        return ROWS[needle.cell // 3]
    return MOTIONS[o.motion]


def lists_sample(seed: int, cfg: NiahConfig, question: str = MAIN) -> NiahSample:
    """One clip (`niah_sample` with `LOOK`) and the answer to `question`, one of `QUESTIONS`."""
    if question not in QUESTIONS:
        raise ValueError(f"unknown question {question!r}; ask one of {sorted(QUESTIONS)}")
    attribute = QUESTIONS[question]
    smp = niah_sample(seed, lists_config(cfg))
    words = [word(n, attribute) for n in smp.needles]
    # the answer's i-th word looks up needle i (its colour and order), on its tokens in its cell (the
    # row's answer is the cell's; where none of its tokens is in the cell, on all of them); the full
    # stop every needle
    attend = [(n.obj.colour + 1, i + 1, n.cell + 1) for i, n in enumerate(smp.needles)] + [(-1, 0, 0)]
    return replace(smp, caption=" ".join([*words, "."]), question=question, attend=attend)


def draw_question(rng: random.Random, weights: tuple[float, ...] | None = None) -> str:
    """One of `QUESTIONS`, drawn with `weights` (in `QUESTIONS`' order; None: `WEIGHTS`)."""
    if weights is not None and (len(weights) != len(QUESTIONS) or min(weights) < 0 or not sum(weights)):
        raise ValueError(f"weights must be {len(QUESTIONS)} non-negative numbers, not all 0, got {weights}")
    return rng.choices(list(QUESTIONS), weights=list(weights or WEIGHTS.values()))[0]


def field_scores(generated: str, reference: str) -> list[int]:
    """[right, out of the reference's]: word i against word i (a missing word is wrong), and the count."""
    g, r = generated.split(), reference.split()
    words = r[:-1] if r and r[-1] == "." else r
    right = sum(int(i < len(g) and g[i] == w) for i, w in enumerate(words))
    return [right, len(words)]
