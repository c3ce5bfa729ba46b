"""Dense narration of a synthetic clip: long answers (about 150-300 tokens) that depend on every time step.

The clips are the captioning task's (`task.py`: coloured shapes that move, appear or disappear
over a textured background) shown at a fixed 4 fps, so each temporal patch of two frames is half
a second and one M-RoPE temporal position: step k of the narration is temporal position k - 1.
The answer narrates every step of the clip, in colour order, each object that is visible:

    step one : red circle top left moves right . blue square middle center still .
    step two : red circle top center moves right . blue square middle center disappears .
    step three : red circle top center moves right .
    ...

Row and column name the object's cell of a 3 x 3 grid at that step, so a moving object changes
its clause exactly when it crosses a cell border: a draft that loses one step's object tokens
mispredicts that step's clause. The prompt varies, so what the answer needs from the video
depends on the question (the target's attention from the question to the video carries that):

- `narrate the video .`: every object at every step (the long answer);
- `narrate the red object .`: one object's clauses (`nothing .` at steps where it is not visible);
- `where does the triangle go ?`: one object's cell per step (`step one : top left .`).

Everything is a pure function of (seed, config), like the captioning task.
"""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from hippo.cli.pair.task import (
    COLOURS,
    MOTION_WORDS,
    MOTIONS,
    SHAPES,
    TEMPORAL,
    Obj,
    Sample,
    TaskConfig,
    sample,
)

FPS = 4.0  # frames per second: one temporal patch (2 frames) = 0.5 s = one M-RoPE temporal position
MAX_STEPS = 16
NUMBERS = (
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
).split()
ROWS = ("top", "middle", "bottom")
COLUMNS = ("left", "center", "right")
KINDS = ("all", "colour", "shape")
#: the share of each question kind in training and evaluation draws
KIND_WEIGHTS = (0.6, 0.2, 0.2)
#: words the narration task adds to the captioning vocabulary, in a fixed order
NARRATION_WORDS = (
    *NUMBERS[3:],
    "step",
    ":",
    "top",
    "middle",
    "bottom",
    "center",
    "still",
    "narrate",
    "where",
    "does",
    "go",
    "nothing",
)


def narration_config(size: int = 112, frames: int = 32, **kw) -> TaskConfig:
    """A task config at 4 fps (the clip lasts frames / 4 seconds); at most 16 steps (32 frames)."""
    if frames % TEMPORAL or not 2 <= frames <= TEMPORAL * MAX_STEPS:
        raise ValueError(f"frames must be even and at most {TEMPORAL * MAX_STEPS}, got {frames}")
    return TaskConfig(size=size, frames=frames, clip_seconds=frames / FPS, cues=True, **kw)


#: the benchmark setting: 168 px, 32 frames (8 s at 4 fps), 16 steps, 576 visual tokens, 2-3 objects
#: (so that narrating everything takes more than 256 tokens)
NARRATE_BENCH = narration_config(168, 32, min_objects=2)


def question(kind: str, arg: str | None = None) -> str:
    if kind == "all":
        return "narrate the video ."
    if kind == "colour":
        return f"narrate the {arg} object ."
    if kind == "shape":
        return f"where does the {arg} go ?"
    raise ValueError(f"unknown question kind {kind!r}; one of {KINDS}")


def _cell(obj: Obj, step: int, size: int) -> str:
    x, y = obj.centres[TEMPORAL * step : TEMPORAL * step + TEMPORAL].mean(0).tolist()  # the patch's centre
    return f"{ROWS[min(2, int(3 * y / size))]} {COLUMNS[min(2, int(3 * x / size))]}"


def _doing(obj: Obj, step: int) -> str | None:
    """What the object does at this step, or None when it is not visible at all."""
    seen = obj.visible[TEMPORAL * step : TEMPORAL * step + TEMPORAL].tolist()
    if not any(seen):
        return None
    if not all(seen):  # the change happens inside the patch
        return "appears" if seen[-1] else "disappears"
    motion = MOTIONS[obj.motion]
    return "still" if motion in ("appears", "disappears") else MOTION_WORDS[motion]


def narrate(objects: list[Obj], cfg: TaskConfig, kind: str = "all", arg: str | None = None) -> str:
    """The reference answer to `question(kind, arg)` about a clip with these objects."""
    steps = cfg.frames // TEMPORAL
    objects = sorted(objects, key=lambda o: o.colour)
    if kind == "colour":
        objects = [o for o in objects if COLOURS[o.colour] == arg]
    elif kind == "shape":
        objects = [o for o in objects if SHAPES[o.shape] == arg]
    parts = []
    for j in range(steps):
        clauses = []
        for o in objects:
            doing = _doing(o, j)
            if doing is None:
                continue
            where = _cell(o, j, cfg.size)
            if kind == "shape":
                clauses.append(f"{where} .")
            else:
                clauses.append(f"{COLOURS[o.colour]} {SHAPES[o.shape]} {where} {doing} .")
        parts.append(f"step {NUMBERS[j]} : " + (" ".join(clauses) if clauses else "nothing ."))
    return " ".join(parts)


def draw_question(rng: random.Random, objects: list[Obj]) -> tuple[str, str | None]:
    """A question kind and its argument: a colour on screen, or a shape only one object has."""
    kind = rng.choices(KINDS, weights=KIND_WEIGHTS)[0]
    if kind == "colour":
        return kind, COLOURS[rng.choice(objects).colour]
    if kind == "shape":
        unique = [o.shape for o in objects if sum(p.shape == o.shape for p in objects) == 1]
        if unique:
            return kind, SHAPES[rng.choice(unique)]
    return "all", None


def narration_sample(
    seed: int,
    cfg: TaskConfig = NARRATE_BENCH,
    *,
    ask: tuple[str, str | None] | None = None,
    blank: bool = False,
) -> Sample:
    """A clip and the answer to one question about it: `ask` = (kind, arg), or drawn from the seed.

    A colour or shape that no object has gets `nothing .` at every step; a shape two objects
    share gets both cells, in colour order.
    """
    clip = sample(seed, cfg, blank=blank)
    kind, arg = ask if ask is not None else draw_question(random.Random(seed ^ 0x5EED), clip.objects)
    return replace(clip, caption=narrate(clip.objects, cfg, kind, arg), question=question(kind, arg))


def draw_batch_question(rng: random.Random) -> tuple[str, str | None]:
    """One question for a whole training batch (a batch shares its prompt)."""
    kind = rng.choices(KINDS, weights=KIND_WEIGHTS)[0]
    return kind, {"all": None, "colour": rng.choice(COLOURS), "shape": rng.choice(SHAPES)}[kind]


def attention_targets(smp: Sample) -> list[tuple[int, int, int]]:
    """Per answer word, what its prediction must look up: (colour + 1, step + 1, cell + 1), or zeros.

    A clause's words after its colour (shape, row, column, what it does) describe one object at one
    step, in one 3 x 3 cell (row * 3 + column, as the visual tokens' `cell` labels; 0 where the
    clause names none); the model predicting them should attend to that object's visual tokens at
    that step, those in the named cell first (the visual tokens whose `colour`, `step` and `cell`
    labels are these): an object's tokens can straddle a cell border, and only the tokens in its
    cell carry the cell the clause names. For `where does the <shape> go ?` the clause's row and
    column, the k-th clause of a step being the k-th visible object of that shape in colour order.
    Training uses it as an auxiliary loss on the language model's attention (`train.attention_loss`);
    any answer text works, a teacher's included.
    """
    words = smp.caption.split()
    out = [(0, 0, 0)] * len(words)
    shape = smp.question.split()[3] if smp.question.startswith("where does the") else None
    objects = sorted(smp.objects, key=lambda o: o.colour)

    def cell(row: int) -> int:  # the cell named by words[row], words[row + 1], + 1; 0: none
        named = words[row : row + 2]
        if len(named) == 2 and named[0] in ROWS and named[1] in COLUMNS:
            return 3 * ROWS.index(named[0]) + COLUMNS.index(named[1]) + 1
        return 0

    step, clause, i = -1, 0, 0
    while i < len(words):
        if words[i] == "step" and words[i + 1 : i + 2] and words[i + 1] in NUMBERS:
            step, clause, i = NUMBERS.index(words[i + 1]), 0, i + 3  # "step <number> :"
            continue
        j = i
        while j < len(words) and words[j] != "." and words[j] != "step":
            j += 1
        if step >= 0 and words[i:j] != ["nothing"]:
            if shape is None:  # colour shape row column what-it-does...
                if words[i] in COLOURS:
                    for k in range(i + 1, min(j, i + 5)):
                        out[k] = (COLOURS.index(words[i]) + 1, step + 1, cell(i + 2))
            else:  # row column
                seen = [o for o in objects if SHAPES[o.shape] == shape and _doing(o, step) is not None]
                if clause < len(seen):
                    for k in range(i, min(j, i + 2)):
                        out[k] = (seen[clause].colour + 1, step + 1, cell(i))
            clause += 1
        # past the clause's "." (or a "step" that starts no step, as a teacher's answer may hold)
        i = j + 1 if j < len(words) and (words[j] == "." or j == i) else j
    return out


def split_steps(text: str) -> dict[str, list[str]]:
    """Narration words per step (keyed by the step's number word); text outside a step is dropped."""
    steps: dict[str, list[str]] = {}
    current = None
    words = text.split()
    for i, w in enumerate(words):
        if w == "step" and i + 1 < len(words) and words[i + 1] in NUMBERS:
            current = words[i + 1]
            steps[current] = []
        elif current is not None:
            steps[current].append(w)
    return steps


def step_token_score(generated: str, reference: str) -> tuple[int, int]:
    """Words right, out of the reference's, compared position by position within each step.

    Aligning per step keeps one early slip (an object named at the wrong step) from shifting
    every later word; a missing or extra step counts all its reference words wrong.
    """
    gen, ref = split_steps(generated), split_steps(reference)
    right = sum(2 + sum(g == r for g, r in zip(gen[k], words)) for k, words in ref.items() if k in gen)
    return right, sum(2 + len(words) for words in ref.values())  # 2: "step" and the step's number


FIELDS = ("clauses", "colour", "shape", "cell", "doing")


def field_scores(generated: str, reference: str) -> dict[str, list[int]]:
    """Per field, [right, out of the reference's]: what part of the narration a model gets wrong.

    `clauses`: steps whose number of clauses (objects named) is the reference's. The other fields
    compare clause by clause within a step, in order: colour, shape, cell (row and column) and what
    the object does; a `where does ... go ?` clause has a cell only. Reference clauses missing from
    the answer count as wrong.
    """
    gen, ref = split_steps(generated), split_steps(reference)
    scores = {f: [0, 0] for f in FIELDS}

    def clauses(words: list[str]) -> list[list[str]]:  # a step's words: its number, ":", clauses
        text = " ".join(words[2:] if words[1:2] == [":"] else words[1:])
        return [c for c in (part.split() for part in text.split(".")) if c and c != ["nothing"]]

    for k, words in ref.items():
        r, g = clauses(words), clauses(gen.get(k, []))
        scores["clauses"][0] += len(r) == len(g)
        scores["clauses"][1] += 1
        for i, rc in enumerate(r):
            gc = g[i] if i < len(g) else []
            parts = {"cell": (rc[:2], gc[:2])}
            if len(rc) > 2:  # colour shape row column doing...
                parts = {
                    "colour": (rc[:1], gc[:1]),
                    "shape": (rc[1:2], gc[1:2]),
                    "cell": (rc[2:4], gc[2:4]),
                    "doing": (rc[4:], gc[4:]),
                }
            for name, (a, b) in parts.items():
                scores[name][0] += a == b
                scores[name][1] += 1
    return scores


def answer_lengths(
    seeds: range, cfg: TaskConfig = NARRATE_BENCH, ask: tuple[str, str | None] | None = None
) -> torch.Tensor:
    """Words in the reference answers (each word is one token of the benchmark tokenizer)."""
    return torch.tensor([len(narration_sample(s, cfg, ask=ask).caption.split()) for s in seeds])
