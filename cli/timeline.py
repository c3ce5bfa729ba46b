"""`--timeline FILE.png`: a Gantt chart of one run, drawn from its event record (HIPPO's Figure 5).

    out = pipe.generate(inputs, max_new_tokens=256, timeline=True)
    draw_timeline(out.stats, "timeline.png")

Two lanes, the target p above the draft q; the x axis is time since `generate` began. Target:
vision encoding, prefill, pruning, verification passes (a pass that rejected a draft token is
marked), plain steps. Draft: vision, prefill, and each drafting split by what became of its tokens
(accepted, rejected by the target, never verified), drawn as if each token took the same time.
The drafting done before the first token (hippo's synchronous-prefill buffer) is outlined, and
aborted draftings (stopped early because their tokens were no longer wanted) are cross-hatched.
A lane's white gaps are its idle time. The lower panel zooms on the prefill and the first rounds.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path

from matplotlib.figure import Figure  # Agg canvas, no pyplot: no global backend or figure state
from matplotlib.patches import Patch

from hippo.events import Event
from hippo.executor import overlap_seconds
from hippo.types import Stats

LANE_Y = {"target": 1.0, "draft": 0.0}
HEIGHT = 0.6
COLOURS = {
    ("target", "vision"): "#8c6bb1",
    ("target", "prefill"): "#2b5d9c",
    ("target", "prune"): "#e7a1c9",
    ("target", "verify"): "#f28e2b",
    ("target", "step"): "#7f7f7f",
    ("draft", "vision"): "#bcaad8",
    ("draft", "prefill"): "#7fa6d6",
    "accepted": "#3a9e3a",
    "rejected": "#d62728",
    "unverified": "#c9c9c9",
    "buffer": "#b8860b",
    "reject mark": "#8b0000",
    "prefill window": "#dfe9f5",
}
ZOOM_ROUNDS = 12  # verify passes shown in the zoomed panel


def hidden_fraction(events: list[Event]) -> float:
    """Share of the draft's busy time that overlapped the target's (the draft time hidden)."""
    draft = [(e.start, e.end) for e in events if e.lane == "draft"]
    target = [(e.start, e.end) for e in events if e.lane == "target"]
    busy = sum(e - s for s, e in draft)
    return overlap_seconds(draft, target) / busy if busy > 0 else 0.0


def _title(stats: Stats, events: list[Event]) -> str:
    drafted = sum(e.depth for e in events if e.lane == "draft" and e.kind in ("draft", "buffer"))
    aborted = sum(e.aborted for e in events)
    return (
        f"{stats.scheduler or 'run'}: {stats.new_tokens} tokens in {stats.seconds_total:.2f} s "
        f"({stats.tokens_per_second:.1f} tok/s) | MAT {stats.mat:.2f} | {stats.rounds} verify passes | "
        f"{drafted} draft tokens, {aborted} draftings aborted | draft hidden {hidden_fraction(events):.0%}"
    )


def _bar(ax, x0: float, width: float, y: float, height: float = HEIGHT, **style) -> None:
    ax.broken_barh([(x0, width)], (y, height), **{"linewidth": 0, "zorder": 2, **style})


def _draw(ax, events: list[Event], scale: float) -> None:
    for prefill in (e for e in events if e.lane == "target" and e.kind == "prefill"):
        ax.axvspan(prefill.start * scale, prefill.end * scale, color=COLOURS["prefill window"], zorder=0)
    for e in events:
        y, x0, w = LANE_Y[e.lane] - HEIGHT / 2, e.start * scale, e.seconds * scale
        if e.lane == "draft" and e.kind in ("draft", "buffer"):
            # the drafting split by its tokens' fate, in position order, as if each took the same time
            x = x0
            fates = [(e.accepted, "accepted"), (e.rejected, "rejected"), (e.unverified, "unverified")]
            for count, name in fates:
                if count:
                    _bar(ax, x, w * count / max(1, e.depth), y, facecolors=COLOURS[name])
                    x += w * count / max(1, e.depth)
            if e.kind == "buffer":
                outline = {
                    "facecolors": "none",
                    "edgecolors": COLOURS["buffer"],
                    "linewidth": 2.2,
                    "zorder": 3,
                }
                _bar(ax, x0, w, y - 0.08, HEIGHT + 0.16, **outline)
            if e.aborted:
                _bar(
                    ax, x0, w, y, facecolors="none", edgecolors="black", hatch="xxx", linewidth=0.6, zorder=3
                )
            continue
        _bar(
            ax,
            x0,
            w,
            y,
            facecolors=COLOURS.get((e.lane, e.kind), "#555555"),
            edgecolors="white",
            linewidth=0.3,
        )
        if e.kind == "verify" and e.accepted < e.depth:  # this pass rejected a draft token
            _bar(ax, x0, w, y + HEIGHT * 0.8, HEIGHT * 0.2, facecolors=COLOURS["reject mark"], zorder=3)


def _zoom_window(events: list[Event]) -> tuple[float, float] | None:
    """From just before the target's prefill ends to the end of its first ZOOM_ROUNDS verify passes."""
    prefills = [e for e in events if e.lane == "target" and e.kind == "prefill"]
    verifies = [e for e in events if e.lane == "target" and e.kind == "verify"]
    if not prefills or len(verifies) <= ZOOM_ROUNDS:
        return None
    t1 = verifies[ZOOM_ROUNDS - 1].end
    return max(0.0, prefills[0].end - 0.08 * (t1 - prefills[0].end)), t1


def _present(events: list[Event]) -> set:
    """The legend entries this run needs (an entry per thing drawn, and idle)."""
    keys = {(e.lane, e.kind) for e in events if e.kind not in ("draft", "buffer")}
    drafts = [e for e in events if e.lane == "draft" and e.kind in ("draft", "buffer")]
    keys |= {name for name in ("accepted", "rejected", "unverified") if any(getattr(e, name) for e in drafts)}
    keys |= {"buffer"} if any(e.kind == "buffer" for e in drafts) else set()
    keys |= {"aborted"} if any(e.aborted for e in drafts) else set()
    keys |= {"reject mark"} if any(e.kind == "verify" and e.accepted < e.depth for e in events) else set()
    keys |= {"prefill window"} if ("target", "prefill") in keys else set()
    return keys | {"idle"}


def _legend_handles(present: set) -> list[Patch]:
    c = COLOURS
    entries = [
        (("target", "vision"), Patch(color=c["target", "vision"], label="vision encoding (p)")),
        (("draft", "vision"), Patch(color=c["draft", "vision"], label="vision encoding (q)")),
        (("target", "prefill"), Patch(color=c["target", "prefill"], label="prefill (p)")),
        (("draft", "prefill"), Patch(color=c["draft", "prefill"], label="prefill (q, pruned video)")),
        (("target", "prune"), Patch(color=c["target", "prune"], label="token pruning")),
        (("target", "verify"), Patch(color=c["target", "verify"], label="verification (p)")),
        ("reject mark", Patch(color=c["reject mark"], label="verification that rejected")),
        (("target", "step"), Patch(color=c["target", "step"], label="plain target step")),
        ("accepted", Patch(color=c["accepted"], label="drafted, accepted")),
        ("rejected", Patch(color=c["rejected"], label="drafted, rejected")),
        ("unverified", Patch(color=c["unverified"], label="drafted, discarded unverified")),
        ("buffer", Patch(facecolor="none", edgecolor=c["buffer"], linewidth=2, label="sync-prefill buffer")),
        ("aborted", Patch(facecolor="white", edgecolor="black", hatch="xxx", label="aborted drafting")),
        ("prefill window", Patch(color=c["prefill window"], label="target prefill window")),
        ("idle", Patch(facecolor="white", edgecolor="#999999", label="idle (white gaps)")),
    ]
    return [patch for key, patch in entries if key in present]


def draw_timeline(stats: Stats, path: str | PathLike, title: str | None = None, *, zoom: bool = True) -> Path:
    """Write the run's Gantt chart to `path` (PNG); `stats` from `generate(..., timeline=True)`.

    `title` replaces the default (scheduler, tokens, tok/s, MAT, passes, draft hidden). With `zoom`
    (and enough rounds) a second panel shows the prefill and the first rounds up close.
    """
    events = list(stats.events)
    if not events:
        raise ValueError("stats has no events: call generate(..., timeline=True)")
    end = max(e.end for e in events)
    unit, scale = ("s", 1.0) if end > 5.0 else ("ms", 1e3)
    window = _zoom_window(events) if zoom else None
    panels = 2 if window is not None else 1
    fig = Figure(figsize=(15, 2.3 + 2.2 * panels))
    axes = fig.subplots(panels, 1, squeeze=False)
    for i, ax in enumerate(axes[:, 0]):
        _draw(ax, events, scale)
        ax.set_yticks([LANE_Y["draft"], LANE_Y["target"]], ["draft q", "target p"])
        ax.set_ylim(-0.6, 1.6)
        ax.set_xlabel(f"time since generate() began ({unit})")
        ax.grid(axis="x", alpha=0.3, zorder=0)
        if i == 0:
            ax.set_xlim(0, end * scale * 1.005)
            ax.set_title(title or _title(stats, events), fontsize=10)
        else:
            ax.set_xlim(window[0] * scale, window[1] * scale)
            ax.set_title(
                f"zoom: the end of the target's prefill and its first {ZOOM_ROUNDS} verify passes", fontsize=9
            )
    fig.legend(
        handles=_legend_handles(_present(events)), loc="lower center", ncol=5, fontsize=8, frameon=False
    )
    fig.tight_layout(rect=(0, 0.13 if panels == 2 else 0.22, 1, 1))
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out
