"""Needle in a video haystack: long clips where a long answer depends on a few brief events.

In the style of V-NIAH / VideoNIAH. A clip is a long haystack: a textured background that drifts
sideways every frame and grey distractor shapes that circle the whole time. Into it go K needles
(K = 7 or 8): coloured shapes (the captioning task's colours and shapes) that are on screen for one
second only, moving left, right, up or down. Needle i sits at depth i / (K - 1) of the clip
(jittered), so there is always a needle at the very start (this defeats recency bias) and one at
the very end; with `small` probability a needle is drawn small (radius 4-5 px, under a fifth of a
visual token: it differs from the background in a small patch only, which defeats similarity
merging).

The question is `what happens ?`; the answer lists the needles in temporal order:

    eight objects . one : red circle middle left moves right . two : blue square top center moves up . ...

Each needle's clause names its colour, shape, 3 x 3 cell (at the middle of its second) and
direction, 9 tokens, so answers hold 66-75 tokens, and everything after the first three depends on
the needles and their order: a draft that lost a needle's few visual tokens mispredicts its clause.
The drifting background and circling distractors make temporal change and spatial distinctiveness
fire everywhere, so only a score that knows what the question needs finds the needles.

Everything is a pure function of (seed, config), like the captioning and narration tasks.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from hippo.cli.pair.narration import COLUMNS, NUMBERS, ROWS
from hippo.cli.pair.task import (
    COLOURS,
    MERGED,
    MOTION_WORDS,
    MOTIONS,
    RGB,
    SHAPES,
    TEMPORAL,
    Obj,
    Sample,
    _background,
    _cell_index,
    _mask,
)

QUESTION = "what happens ?"
FPS = 4.0  # one temporal patch (2 frames) = 0.5 s = one M-RoPE temporal position
NEEDLE_PATCHES = 2  # a needle is on screen for 2 temporal patches (1 s)
DIRECTIONS = (0, 1, 2, 3)  # indices into task.MOTIONS: left, right, up, down
GREYS = (0.12, 0.9)  # distractor shades: darker and lighter than any background


@dataclass(frozen=True)
class NiahConfig:
    size: int = 168  # frame height = width, a multiple of 28 (6 x 6 visual tokens per temporal patch)
    frames: int = 96  # even
    needles: tuple[int, int] = (7, 8)
    distractors: tuple[int, int] = (1, 2)
    small: float = 0.15  # chance that a needle is drawn small (radius 4-5 px)
    radius: tuple[float, float] = (10.0, 13.0)
    speed: tuple[float, float] = (5.0, 7.0)  # px per frame, needles
    drift: float = 1.0  # px per frame, the background's sideways drift
    fps: float = FPS  # the clip's frame rate (the processor's `fps`: M-RoPE temporal positions per second)

    def __post_init__(self):
        if self.size % MERGED or self.frames % TEMPORAL:
            raise ValueError(f"size must be a multiple of {MERGED} and frames even, got {self}")
        if self.frames // TEMPORAL < self.needles[1] * NEEDLE_PATCHES:
            raise ValueError(
                f"{self.frames} frames hold at most {self.frames // (TEMPORAL * NEEDLE_PATCHES)} needles of "
                f"{NEEDLE_PATCHES * TEMPORAL} frames, not {self.needles[1]}"
            )

    @property
    def grid(self) -> tuple[int, int, int]:  # merged visual tokens (t, h, w)
        return self.frames // TEMPORAL, self.size // MERGED, self.size // MERGED

    @property
    def visual_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w


def config_for(visual_tokens: int, size: int = 168, **kw) -> NiahConfig:
    """The clip of `size` px with about `visual_tokens` visual tokens (an even number of frames)."""
    per_patch = (size // MERGED) ** 2
    patches = max(NiahConfig.needles[1] * NEEDLE_PATCHES, round(visual_tokens / per_patch))
    return NiahConfig(size=size, frames=TEMPORAL * patches, **kw)


@dataclass
class Needle:
    obj: Obj  # its centres/visible over the needle's own frames only
    start: int  # first frame
    depth: float  # start / the last possible start, in [0, 1]
    cell: int  # 3 x 3 cell (row * 3 + column) of its centre at the middle of its span

    @property
    def frames(self) -> range:
        return range(self.start, self.start + NEEDLE_PATCHES * TEMPORAL)

    def clause(self, order: int) -> str:
        row, col = divmod(self.cell, 3)
        o = self.obj
        return f"{NUMBERS[order]} : {COLOURS[o.colour]} {SHAPES[o.shape]} {ROWS[row]} {COLUMNS[col]} {MOTION_WORDS[MOTIONS[o.motion]]} ."


@dataclass
class NiahSample(Sample):
    needles: list[Needle] | None = None
    #: per answer token, what its prediction must look up: (colour + 1, needle order + 1, cell + 1) as
    #: the visual tokens' `colour`, `step` and `cell` labels; (-1, 0, 0): every needle (the count)
    attend: list[tuple[int, int, int]] | None = None


def answer(needles: list[Needle]) -> str:
    count = NUMBERS[len(needles) - 1]
    return " ".join([f"{count} objects .", *(n.clause(i) for i, n in enumerate(needles))])


def _attend(needles: list[Needle]) -> list[tuple[int, int, int]]:
    out = [(-1, 0, 0), (0, 0, 0), (0, 0, 0)]  # "<count> objects ." after the prompt: every needle
    for i, n in enumerate(needles):
        look = (n.obj.colour + 1, i + 1, n.cell + 1)
        out += [(0, 0, 0), (0, 0, 0), look, look, look, look, look, look, (0, 0, 0)]  # "<i> :" ... "."
    return out


def _needle(rng: random.Random, cfg: NiahConfig, start: int, depth: float) -> Needle:
    S, F = cfg.size, NEEDLE_PATCHES * TEMPORAL
    small = rng.random() < cfg.small
    r = rng.uniform(4.0, 5.0) if small else rng.uniform(*cfg.radius)
    motion = rng.choice(DIRECTIONS)
    speed = rng.uniform(*cfg.speed)
    lo, hi = 4 + r + 3, S - 4 - r - 3
    travel = speed * (F - 1)
    sign = 1.0 if MOTIONS[motion] in ("right", "down") else -1.0
    along0 = rng.uniform(lo, hi - travel) if sign > 0 else rng.uniform(lo + travel, hi)
    axis = 0 if MOTIONS[motion] in ("left", "right") else 1
    centres = torch.empty(F, 2)
    centres[:, axis] = along0 + sign * speed * torch.arange(F, dtype=torch.float32)
    centres[:, 1 - axis] = rng.uniform(lo, hi)
    mid = centres[F // 2 - 1 : F // 2 + 1].mean(0)
    cell = int(_cell_index(mid[1], S)) * 3 + int(_cell_index(mid[0], S))
    obj = Obj(
        rng.randrange(len(COLOURS)),
        rng.randrange(len(SHAPES)),
        motion,
        r,
        centres,
        torch.ones(F, dtype=torch.bool),
    )
    return Needle(obj, start, depth, cell)


def niah_sample(seed: int, cfg: NiahConfig = NiahConfig()) -> NiahSample:
    """One clip, its needles and the answer to `QUESTION`, a pure function of (seed, cfg)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    T, S = cfg.frames, cfg.size
    t = T // TEMPORAL
    K = rng.randint(*cfg.needles)
    last = t - NEEDLE_PATCHES  # the last temporal patch a needle can start at
    # needle i near depth i / (K - 1), jittered within its slot; slots never overlap
    slot = last / (K - 1)
    starts = []
    for i in range(K):
        if i in (0, K - 1):
            p = 0 if i == 0 else last
        else:
            p = round(i * slot + rng.uniform(-0.3, 0.3) * slot)
        lo = starts[-1] + NEEDLE_PATCHES if starts else 0
        starts.append(min(max(p, lo), last - NEEDLE_PATCHES * (K - 1 - i)))
    needles = [_needle(rng, cfg, TEMPORAL * p, p / last) for p in starts]

    base = _background_cfg(cfg, gen)  # [H, W, 3]
    shifts = (torch.arange(T, dtype=torch.float32) * cfg.drift).round().long() % S
    cols = (torch.arange(S)[None, :] - shifts[:, None]) % S  # [T, W]: each frame's columns of `base`
    video = base[:, cols].permute(1, 0, 2, 3).contiguous()  # [T, H, W, 3]
    border = 4
    video[:, :border], video[:, -border:], video[:, :, :border], video[:, :, -border:] = 1.0, 1.0, 1.0, 1.0
    # distractors: grey shapes circling the whole clip
    for _ in range(rng.randint(*cfg.distractors)):
        r = rng.uniform(*cfg.radius)
        cx, cy = rng.uniform(0.35, 0.65) * S, rng.uniform(0.35, 0.65) * S
        radius = rng.uniform(0.15, 0.25) * S
        phase, omega = rng.uniform(0, 2 * math.pi), rng.choice((-1, 1)) * rng.uniform(0.08, 0.15)
        a = phase + omega * torch.arange(T, dtype=torch.float32)
        m = _mask(rng.randrange(len(SHAPES)), cx + radius * torch.cos(a), cy + radius * torch.sin(a), r, S)
        video = torch.where(m[..., None], torch.tensor(rng.choice(GREYS)).expand(3), video)
    labels = {k: torch.zeros(cfg.grid, dtype=torch.long) for k in ("colour", "shape", "motion", "step")}
    best = torch.zeros(cfg.grid)
    for i, n in enumerate(needles):
        o, f = n.obj, n.frames
        m = _mask(o.shape, o.centres[:, 0], o.centres[:, 1], o.radius, S)  # [F, H, W]
        shade = (RGB[o.colour] + 0.04 * (torch.rand(3, generator=gen) - 0.5)).clamp(0, 1)
        video[f.start : f.stop] = torch.where(m[..., None], shade, video[f.start : f.stop])
        h = S // MERGED
        cover = m.float().view(NEEDLE_PATCHES, TEMPORAL, h, MERGED, h, MERGED).mean(dim=(1, 3, 5))
        p0 = f.start // TEMPORAL
        window = best[p0 : p0 + NEEDLE_PATCHES]
        take = (cover >= 0.06) & (cover > window)
        best[p0 : p0 + NEEDLE_PATCHES] = torch.where(take, cover, window)
        for name, value in (
            ("colour", o.colour + 1),
            ("shape", o.shape + 1),
            ("motion", o.motion + 1),
            ("step", i + 1),
        ):
            labels[name][p0 : p0 + NEEDLE_PATCHES][take] = value
        # a sliver of a shape does not show the shape
        labels["shape"][p0 : p0 + NEEDLE_PATCHES][take & (cover < 0.15)] = -1
    flat = {k: v.flatten() for k, v in labels.items()}
    th, tw = cfg.grid[1:]
    centre = (torch.arange(th, dtype=torch.float32) + 0.5) * MERGED
    cell = _cell_index(centre, S)
    flat["cell"] = (cell[:, None] * 3 + cell[None, :]).expand(cfg.grid).flatten() + 1
    return NiahSample(
        video=video,
        objects=[n.obj for n in needles],
        caption=answer(needles),
        token_labels=flat,
        question=QUESTION,
        fps=cfg.fps,
        needles=needles,
        attend=_attend(needles),
    )


def _background_cfg(cfg: NiahConfig, gen: torch.Generator) -> torch.Tensor:
    from hippo.cli.pair.task import TaskConfig

    return _background(TaskConfig(size=cfg.size, frames=TEMPORAL), gen)


def needle_rows(smp: NiahSample) -> torch.Tensor:
    """Indices of the visual tokens that show a needle (the oracle selector keeps these)."""
    return (smp.token_labels["step"] > 0).nonzero().flatten()


def needle_scores(generated: str, reference: str) -> dict[str, list[int]]:
    """Per field, [right, out of the reference's], clause by clause in order: count, colour, shape,
    cell (row and column) and direction. A missing clause counts all its fields wrong."""

    def clauses(text: str) -> tuple[str | None, list[list[str]]]:
        parts = [p.split() for p in text.split(".")]
        head = parts[0][0] if parts and parts[0] else None
        body = [p[2:] for p in parts[1:] if len(p) > 2 and p[1] == ":"]
        return head, body

    gh, gc = clauses(generated)
    rh, rc = clauses(reference)
    scores = {
        "count": [int(gh == rh), 1],
        "colour": [0, 0],
        "shape": [0, 0],
        "cell": [0, 0],
        "direction": [0, 0],
    }
    for i, r in enumerate(rc):
        g = gc[i] if i < len(gc) else []
        for name, sl in (
            ("colour", slice(0, 1)),
            ("shape", slice(1, 2)),
            ("cell", slice(2, 4)),
            ("direction", slice(4, 6)),
        ):
            scores[name][0] += int(g[sl] == r[sl])
            scores[name][1] += 1
    return scores
