"""A synthetic video-captioning task, generated on the fly and reproducible from a seed.

A video shows a static, low-contrast textured background inside a bright white border, and 1-3
coloured shapes (distinct colours) that move left/right/up/down at a steady speed, or stand still
and appear or disappear part-way through. The caption names the count and, in colour order, each
object's colour, shape and motion:

    "two objects . a red circle moves left . a blue square appears ."

Only the few visual tokens that the objects cover carry the answer. Everything the frames show is
also labelled per visual token (`Sample.token_labels`: colour, shape and motion of the object the
token sees, or background), which training uses as an auxiliary loss.

Two details make the content visible to a single visual token, whose temporal patch spans two
consecutive frames: objects move a few pixels every frame, so the two frames of a patch already
show the direction; and appearances/disappearances happen between frames 2k and 2k+1, inside one
temporal patch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

COLOURS = ("red", "green", "blue", "yellow")
RGB = torch.tensor([[0.92, 0.16, 0.14], [0.12, 0.78, 0.22], [0.18, 0.32, 0.96], [0.96, 0.88, 0.12]])
SHAPES = ("circle", "square", "triangle")
MOTIONS = ("left", "right", "up", "down", "appears", "disappears")
MOTION_WORDS = {
    "left": "moves left",
    "right": "moves right",
    "up": "moves up",
    "down": "moves down",
    "appears": "appears",
    "disappears": "disappears",
}
COUNTS = ("one", "two", "three")
#: every word a caption can contain, in a fixed order (the tokenizer's vocabulary builds on it)
CAPTION_WORDS = (
    *COUNTS,
    "object",
    "objects",
    "a",
    ".",
    *COLOURS,
    *SHAPES,
    "moves",
    *MOTIONS[:4],
    *MOTIONS[4:],
)
QUESTION = "describe the video ."

CUE_DESIGNS = ("angle", "binary")
CLIP_SECONDS = 4.0  # every clip lasts 4 s: more frames means a higher frame rate
BORDER = 4  # px of white frame
MERGED = 28  # px per merged visual token (patch 14 x spatial merge 2)
TEMPORAL = 2  # frames per temporal patch


@dataclass(frozen=True)
class TaskConfig:
    size: int = 112  # frame height = width, a multiple of 28
    frames: int = 8  # even
    min_objects: int = 1
    max_objects: int = 3
    radius: tuple[float, float] = (10.0, 13.0)
    speed: tuple[float, float] = (6.0, 8.0)  # px per frame (capped so the path fits the frame)
    clip_seconds: float = CLIP_SECONDS  # the narration task fixes the frame rate instead (4 fps)
    cues: bool = False  # narration: the clip shows the time step and the 3x3 cell
    #: how the cues are drawn: "angle" (`_angle_cues`, the committed narration pair's) or "binary"
    #: (`_binary_cues`: exact on objects too, a step code attention can resolve; no pair trained yet)
    cue_design: str = "angle"

    def __post_init__(self):
        if self.cue_design not in CUE_DESIGNS:
            raise ValueError(f"cue_design must be one of {CUE_DESIGNS}, got {self.cue_design!r}")

    @property
    def grid(self) -> tuple[int, int, int]:  # merged visual tokens (t, h, w)
        return self.frames // TEMPORAL, self.size // MERGED, self.size // MERGED

    @property
    def fps(self) -> float:
        return self.frames / self.clip_seconds

    @property
    def visual_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w


#: the benchmark setting: 448 px, 16 frames (a 4 s clip at 4 fps), 2,048 visual tokens per video
BENCHMARK = TaskConfig(size=448, frames=16)
#: a longer one: 448 px, 32 frames, 4,096 visual tokens per video
BENCHMARK_LONG = TaskConfig(size=448, frames=32)


@dataclass
class Obj:
    colour: int
    shape: int
    motion: int
    radius: float
    centres: torch.Tensor  # [T, 2] (x, y) px
    visible: torch.Tensor  # [T] bool


@dataclass
class Sample:
    video: torch.Tensor  # [T, H, W, 3] in [0, 1]
    objects: list[Obj]
    caption: str
    token_labels: dict[str, torch.Tensor] = field(
        default_factory=dict
    )  # name -> [t*h*w]: 0 background, -1 unknown
    question: str = QUESTION  # the prompt `caption` answers
    fps: float = 0.0  # frames per second of the clip (0: the captioning task's, frames / CLIP_SECONDS)


def caption_of(objects: list[Obj]) -> str:
    n = len(objects)
    parts = [f"{COUNTS[n - 1]} {'object' if n == 1 else 'objects'}"]
    for o in sorted(objects, key=lambda o: o.colour):
        parts.append(f"a {COLOURS[o.colour]} {SHAPES[o.shape]} {MOTION_WORDS[MOTIONS[o.motion]]}")
    return " . ".join(parts) + " ."


def parse_caption(text: str) -> tuple[str | None, list[tuple[str | None, str | None, str | None]]]:
    """-> (count word, [(colour, shape, motion)]); fields that cannot be read are None."""
    segments = [s.split() for s in text.split(".")]
    segments = [s for s in segments if s]
    if not segments:
        return None, []
    count = segments[0][0] if segments[0][0] in COUNTS else None
    objects = []
    for words in segments[1:]:
        colour = next((w for w in words if w in COLOURS), None)
        shape = next((w for w in words if w in SHAPES), None)
        motion = next((w for w in words if w in MOTIONS), None)
        objects.append((colour, shape, motion))
    return count, objects


def content_score(generated: str, reference: str) -> tuple[int, int, dict[str, list[int]]]:
    """Content words right, out of the reference's; per field [right, total] (count, colour, shape, motion).

    Objects are compared slot by slot in caption order (the caption orders them by colour).
    """
    g_count, g_objs = parse_caption(generated)
    r_count, r_objs = parse_caption(reference)
    fields = {"count": [int(g_count == r_count), 1], "colour": [0, 0], "shape": [0, 0], "motion": [0, 0]}
    for i, ref in enumerate(r_objs):
        gen = g_objs[i] if i < len(g_objs) else (None, None, None)
        for name, g, r in zip(("colour", "shape", "motion"), gen, ref):
            fields[name][0] += int(g == r)
            fields[name][1] += 1
    right = sum(v[0] for v in fields.values())
    total = sum(v[1] for v in fields.values())
    return right, total, fields


def token_score(generated: list[int], reference: list[int]) -> tuple[int, int]:
    """Positions where the generated ids equal the reference's (its end token included), out of its length."""
    return sum(int(g == r) for g, r in zip(generated, reference)), len(reference)


# ---- rendering -------------------------------------------------------------------------------


def _background(cfg: TaskConfig, gen: torch.Generator) -> torch.Tensor:  # -> [H, W, 3]
    S = cfg.size
    base = 0.40 + 0.12 * torch.rand(1, generator=gen)
    tint = 0.03 * (torch.rand(3, generator=gen) - 0.5)
    coarse = torch.rand(1, 3, 6, 6, generator=gen) - 0.5
    smooth = torch.nn.functional.interpolate(coarse, size=(S, S), mode="bilinear", align_corners=False)
    fine = torch.rand(1, 1, S // 4, S // 4, generator=gen) - 0.5
    fine = torch.nn.functional.interpolate(fine, size=(S, S), mode="nearest")
    img = base + tint.view(3, 1, 1) + 0.10 * smooth[0] + 0.04 * fine[0]  # [3, H, W]
    img = img.permute(1, 2, 0).clamp(0, 1)
    img[:BORDER], img[-BORDER:], img[:, :BORDER], img[:, -BORDER:] = 1.0, 1.0, 1.0, 1.0
    return img


#: the narration clips' cues: 16 time steps (temporal patches of 8 s at 4 fps) and a 3 x 3 grid of cells
CLOCK_STEPS = 16
STEP_BITS = 4  # the step is drawn as a 4-bit code: 2^4 = CLOCK_STEPS
CUE_AMPLITUDE = 0.05  # of each cue's pixel pattern, in RGB units
#: the two opponent colour axes a cell's angle lies on (red-green, blue-yellow): zero-sum, unit norm
CUE_AXES = (torch.tensor([1.0, -1.0, 0.0]) / 2**0.5, torch.tensor([-0.5, -0.5, 1.0]) / 1.5**0.5)
LUMINANCE = torch.ones(3) / 3**0.5
#: objects' colours on a cued clip are squeezed into this range so the cues drawn over them never clip
CUED_RANGE = (0.2, 0.8)


def _cell_index(coord: torch.Tensor, size: int) -> torch.Tensor:  # px centre coordinates -> 0, 1, 2
    return (3 * coord / size).long().clamp(0, 2)


def step_code(step: torch.Tensor) -> torch.Tensor:  # [...] 0-based steps -> [..., STEP_BITS] of +-1
    bits = (step[..., None] >> torch.arange(STEP_BITS)) & 1
    return 1.0 - 2.0 * bits.float()


def cue_patterns(size: int) -> dict[str, torch.Tensor]:
    """The three zero-mean pixel patterns of period 2 the cues are drawn with, each [H, W]."""
    sign = 1.0 - 2.0 * (torch.arange(size) % 2).float()  # (-1)^x
    return {
        "checker": sign[:, None] * sign[None, :],
        "rows": sign[:, None].expand(size, size),
        "columns": sign[None, :].expand(size, size),
    }


def _angle_cues(video: torch.Tensor, cfg: TaskConfig) -> torch.Tensor:  # [T, H, W, 3] -> same
    """Make time and place visible, as a clock on the wall and a tiled floor would (the committed
    narration pair's design, `cue_design="angle"`).

    Each cue is a pixel-scale pattern on the background whose colour encodes a value as an angle:
    - the time step (one of 16): a checkerboard, (-1)^(x+y);
    - the cell's row (one of 3): horizontal stripes, (-1)^y;
    - the cell's column (one of 3): vertical stripes, (-1)^x.
    Each pattern's colour is cos(a) u + sin(a) v for the value's angle a on two opponent colour axes.
    Patches start at even pixels, so every visual patch sees each pattern in the same phase: a linear
    read-out recovers the three codes exactly, and the background's smooth noise and 4 px grain add
    nothing to them. An object covering part of a patch scales the codes, which leaves their angles
    (the values) unchanged. Objects are drawn over the cues afterwards. Measured: their edges
    leak into the stripes, and attention cannot tell neighbouring steps' angles apart (the
    `binary` design and benchmarks/README.md).
    """
    T, S = cfg.frames, cfg.size
    rg, by = CUE_AXES

    def colour(index: torch.Tensor, n: int) -> torch.Tensor:  # [...] -> [..., 3]
        a = 2 * torch.pi * index.float() / n
        return CUE_AMPLITUDE * (a.cos()[..., None] * rg + a.sin()[..., None] * by)

    px = torch.arange(S)
    sign = 1.0 - 2.0 * (px % 2).float()  # (-1)^x
    cells = sign[:, None] * colour(_cell_index(px.float() + 0.5, S), 3)  # [S, 3]: row or column code
    rows, cols = cells[:, None, :], cells[None, :, :]  # [H, 1, 3], [1, W, 3]
    checker = (sign[:, None] * sign[None, :])[None, :, :, None]  # [1, H, W, 1]
    steps = colour(torch.arange(T) // TEMPORAL, CLOCK_STEPS)[:, None, None, :]  # [T, 1, 1, 3]
    border = torch.zeros(S, S, dtype=torch.bool)
    border[:BORDER], border[-BORDER:], border[:, :BORDER], border[:, -BORDER:] = True, True, True, True
    cued = video + rows + cols + checker * steps
    return torch.where(border[None, :, :, None], video, cued.clamp(0, 1))


def _binary_cues(video: torch.Tensor, cfg: TaskConfig) -> torch.Tensor:  # [T, H, W, 3] -> same
    """Make time and place visible, as a clock on the wall and a tiled floor would (`cue_design="binary"`).

    Each cue is a pixel pattern of period 2 px times a colour, drawn over the whole picture, objects
    included (the white border excepted):
    - the time step, as 4 bits (+-1 each): the checkerboard (-1)^(x+y) times the red-green, the
      blue-yellow and the luminance axis, and horizontal stripes (-1)^y times luminance. A binary
      code, since attention must tell neighbouring steps apart: an angle code (the first design)
      gave neighbouring steps keys only 8% apart;
    - the cell's row (one of 3): horizontal stripes times cos(a) red-green + sin(a) blue-yellow for
      the row's angle a;
    - the cell's column (one of 3): vertical stripes (-1)^x, likewise.
    Everything else in a cued clip is constant over each 2 x 2 pixel block (the background's 4 px
    grain, the objects, drawn on 2 px blocks by `sample`) or nearly so (its smooth noise), and every
    pattern sums to zero over each block: patches start at even pixels, so a linear read-out of any
    patch, on an object or not, recovers the codes exactly. (Objects drawn on the pixel grid leak
    their edges into the stripes: the first cue design read the cell right on only 62-67% of the
    object tokens, against 99.8% of the background ones.)
    """
    T, S = cfg.frames, cfg.size
    rg, by = CUE_AXES
    pat = cue_patterns(S)

    def angle(index: torch.Tensor, n: int) -> torch.Tensor:  # [...] -> [..., 3]
        a = 2 * torch.pi * index.float() / n
        return a.cos()[..., None] * rg + a.sin()[..., None] * by

    cell = angle(_cell_index(torch.arange(S).float() + 0.5, S), 3)  # [S, 3]: a row's or column's colour
    place = pat["rows"][..., None] * cell[:, None, :] + pat["columns"][..., None] * cell[None, :, :]
    bits = step_code(torch.arange(T) // TEMPORAL)  # [T, 4]
    axes = torch.stack([rg, by, LUMINANCE])  # [3 axes, 3 channels]
    checker = pat["checker"][None, :, :, None] * (bits[:, :3] @ axes)[:, None, None, :]  # [T, H, W, 3]
    stripes = pat["rows"][None, :, :, None] * (bits[:, 3:] * LUMINANCE)[:, None, None, :]
    cued = video + CUE_AMPLITUDE * (place[None] + checker + stripes)
    border = torch.zeros(S, S, dtype=torch.bool)
    border[:BORDER], border[-BORDER:], border[:, :BORDER], border[:, -BORDER:] = True, True, True, True
    return torch.where(border[None, :, :, None], video, cued.clamp(0, 1))


def _cue_labels(cfg: TaskConfig) -> dict[str, torch.Tensor]:
    """Per merged visual token, 1-based: its temporal patch (the step) and the 3 x 3 cell of its centre."""
    t, h, w = cfg.grid
    centre = (torch.arange(h, dtype=torch.float32) + 0.5) * MERGED
    cell = _cell_index(centre, cfg.size)
    cells = (cell[:, None] * 3 + cell[None, :]).expand(t, h, w)
    steps = torch.arange(t).view(t, 1, 1).expand(t, h, w)
    return {"step": steps.flatten() + 1, "cell": cells.flatten() + 1}


def _mask(shape: int, cx: torch.Tensor, cy: torch.Tensor, r: float, S: int, block: int = 1) -> torch.Tensor:
    # cx, cy: [T] -> [T, H, W] bool, decided per `block` x `block` pixels at the block's centre
    if block > 1:
        m = _mask(shape, cx / block, cy / block, r / block, S // block)
        return m.repeat_interleave(block, 1).repeat_interleave(block, 2)
    ys = torch.arange(S, dtype=torch.float32).view(1, S, 1) + 0.5
    xs = torch.arange(S, dtype=torch.float32).view(1, 1, S) + 0.5
    dx, dy = xs - cx.view(-1, 1, 1), ys - cy.view(-1, 1, 1)
    if SHAPES[shape] == "circle":
        return dx * dx + dy * dy <= r * r
    if SHAPES[shape] == "square":
        h = 0.85 * r
        return (dx.abs() <= h) & (dy.abs() <= h)
    # triangle, apex up: base at dy = 0.75 r, apex at dy = -r
    depth = (dy + r) / (1.75 * r)  # 0 at the apex, 1 at the base
    return (dy <= 0.75 * r) & (depth >= 0) & (dx.abs() <= depth * 1.1 * r)


def _place(cfg: TaskConfig, rng: random.Random, motion: str, r: float) -> tuple[torch.Tensor, torch.Tensor]:
    T, S = cfg.frames, cfg.size
    lo, hi = BORDER + r + 3, S - BORDER - r - 3
    visible = torch.ones(T, dtype=torch.bool)
    if motion in ("appears", "disappears"):
        x, y = rng.uniform(lo, hi), rng.uniform(lo, hi)
        centres = torch.tensor([[x, y]]).expand(T, 2).clone()
        # the change happens between frames 2k and 2k+1: inside one temporal patch
        k = rng.randint(1, max(1, T // 2 - 2))
        switch = min(2 * k + 1, T - 1)
        if motion == "appears":
            visible[:switch] = False
        else:
            visible[switch:] = False
        return centres, visible
    speed = rng.uniform(*cfg.speed)
    travel = min(speed * (T - 1), (hi - lo) * 0.95)
    speed = travel / max(T - 1, 1)
    axis = 0 if motion in ("left", "right") else 1
    sign = 1.0 if motion in ("right", "down") else -1.0
    start_along = rng.uniform(lo, hi - travel) if sign > 0 else rng.uniform(lo + travel, hi)
    across = rng.uniform(lo, hi)
    steps = torch.arange(T, dtype=torch.float32) * speed * sign + start_along
    centres = torch.empty(T, 2)
    centres[:, axis] = steps
    centres[:, 1 - axis] = across
    return centres, visible


def _apart(a: Obj, b: Obj) -> bool:
    both = a.visible & b.visible
    if not both.any():
        both = torch.ones_like(both)  # never on screen together: still keep their places apart
    d = (a.centres - b.centres).norm(dim=-1)[both].min()
    return bool(d >= a.radius + b.radius + 6)


def _token_labels(cfg: TaskConfig, objects: list[Obj], masks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per merged visual token: the object covering most of it (>= 6% of its pixels over its two
    frames), as colour/shape/motion class + 1, or 0 for background. A token holding only a sliver
    of an object (< 15%) gets shape -1 (unknown): a sliver does not show the shape."""
    t, h, w = cfg.grid
    best = torch.zeros(t, h, w)
    which = torch.full((t, h, w), -1, dtype=torch.long)
    for i, m in enumerate(masks):  # m [T, H, W]
        cover = m.float().view(t, TEMPORAL, h, MERGED, w, MERGED).mean(dim=(1, 3, 5))  # [t, h, w]
        take = (cover >= 0.06) & (cover > best)
        best = torch.where(take, cover, best)
        which = torch.where(take, torch.full_like(which, i), which)
    labels = {}
    for name in ("colour", "shape", "motion"):
        table = torch.tensor([0] + [getattr(o, name) + 1 for o in objects])
        labels[name] = table[which + 1].flatten()  # 0 = background
    labels["shape"] = torch.where((best.flatten() > 0) & (best.flatten() < 0.15), -1, labels["shape"])
    return labels


def sample(seed: int, cfg: TaskConfig = TaskConfig(), *, blank: bool = False) -> Sample:
    """One video and its caption, a pure function of (seed, cfg). `blank` shows grey frames instead."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    T, S = cfg.frames, cfg.size
    n = rng.randint(cfg.min_objects, cfg.max_objects)
    colours = sorted(rng.sample(range(len(COLOURS)), n))
    objects: list[Obj] = []
    for colour in colours:
        for _attempt in range(100):
            motion = rng.randrange(len(MOTIONS))
            r = rng.uniform(*cfg.radius)
            centres, visible = _place(cfg, rng, MOTIONS[motion], r)
            obj = Obj(colour, rng.randrange(len(SHAPES)), motion, r, centres, visible)
            if all(_apart(obj, o) for o in objects):
                objects.append(obj)
                break
    video = _background(cfg, gen).expand(T, S, S, 3).clone()  # [T, H, W, 3]
    binary = cfg.cues and cfg.cue_design == "binary"
    if cfg.cues and not binary:
        video = _angle_cues(video, cfg)
    block = 2 if binary else 1  # binary cues: objects on 2 px blocks, so the cues read exactly on them
    masks = []
    for o in objects:
        m = _mask(o.shape, o.centres[:, 0], o.centres[:, 1], o.radius, S, block) & o.visible.view(T, 1, 1)
        shade = (RGB[o.colour] + 0.04 * (torch.rand(3, generator=gen) - 0.5)).clamp(0, 1)
        if binary:
            lo, hi = CUED_RANGE
            shade = lo + (hi - lo) * shade
        video = torch.where(m[..., None], shade, video)
        masks.append(m)
    if binary:
        video = _binary_cues(video, cfg)
    labels = _token_labels(cfg, objects, masks)
    if cfg.cues:
        labels.update(_cue_labels(cfg))
    if blank:
        video = torch.full_like(video, 0.5)
    return Sample(video=video, objects=objects, caption=caption_of(objects), token_labels=labels, fps=cfg.fps)


def chance_content_accuracy(seeds: range, cfg: TaskConfig = TaskConfig()) -> float:
    """Content accuracy of the best caption that ignores the video (the most common value per slot)."""
    from collections import Counter

    refs = [parse_caption(sample(s, cfg).caption) for s in seeds]
    counts = Counter(c for c, _ in refs)
    slots: dict[tuple[int, int], Counter] = {}
    for _, objs in refs:
        for i, obj in enumerate(objs):
            for j, v in enumerate(obj):
                slots.setdefault((i, j), Counter())[v] += 1
    best_right = counts.most_common(1)[0][1] + sum(c.most_common(1)[0][1] for c in slots.values())
    total = len(refs) + sum(3 * len(objs) for _, objs in refs)
    return best_right / total
