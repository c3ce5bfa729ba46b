"""Position-bias analysis (paper §4.1, Figs. 2 and 8): do the kept tokens crowd at frame edges?

Boundary tokens are those in the top or bottom `boundary` fraction of a frame's rows (paper: 10% from
the top or bottom edge, about 20% of all tokens): with h rows, the first and last max(1, round(boundary·h))
rows. For each selection method the analysis reports, per frame and overall, the share of kept tokens
that are boundary tokens against the base rate (the share of boundary tokens among all tokens).

    result = position_bias(pipeline, inputs, keep_ratio=0.1)   # JSON-serialisable dict
    plot_position_bias(result, "bias.png")

`position_bias_from_scores` does the same from scores already computed (no model needed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from hippo.errors import ConfigError
from hippo.interfaces import ScoringContext
from hippo.plugins.attention import AttentionScorer
from hippo.plugins.ranked_selectors import TopKSelector
from hippo.plugins.scorers import HolisticScorer
from hippo.types import VisualTokens


def boundary_mask(visual: VisualTokens, boundary: float = 0.1) -> torch.Tensor:  # -> [N] bool
    if not 0.0 <= boundary <= 0.5:
        raise ConfigError(f"boundary must be a fraction of the rows in [0, 0.5], got {boundary!r}")
    parts = []
    for t, h, w in visual.grids:
        b = 0 if boundary == 0 else max(1, round(boundary * h))
        rows = torch.arange(h)
        edge = (rows < b) | (rows >= h - b)
        parts.append(edge.repeat_interleave(w).repeat(t))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)


def _share(num: int, den: int) -> float | None:
    return num / den if den else None


def boundary_stats(visual: VisualTokens, kept: torch.Tensor, boundary: float = 0.1) -> dict[str, Any]:
    """Share of the kept tokens (kept [K] indices) that are boundary tokens, per frame and overall."""
    edge = boundary_mask(visual, boundary)
    frame = visual.frame_index()
    is_kept = torch.zeros(visual.n, dtype=torch.bool)
    is_kept[kept.cpu()] = True
    F = sum(t for t, _, _ in visual.grids)
    count = lambda m: torch.bincount(frame[m], minlength=F).tolist()  # noqa: E731
    n_f, e_f, k_f, ke_f = count(torch.ones_like(edge)), count(edge), count(is_kept), count(is_kept & edge)
    video = [vi for vi, (t, _, _) in enumerate(visual.grids) for _ in range(t)]
    per_frame = [
        {
            "frame": f,
            "video": video[f],
            "tokens": n_f[f],
            "kept": k_f[f],
            "boundary_kept": ke_f[f],
            "boundary_share": _share(ke_f[f], k_f[f]),
            "base_rate": _share(e_f[f], n_f[f]),
        }
        for f in range(F)
    ]
    shares = [p["boundary_share"] for p in per_frame if p["boundary_share"] is not None]
    kept_n, kept_edge, base = (
        int(is_kept.sum()),
        int((is_kept & edge).sum()),
        _share(int(edge.sum()), visual.n),
    )
    share = _share(kept_edge, kept_n)
    return {
        "kept": kept_n,
        "boundary_kept": kept_edge,
        "boundary_share": share,
        "base_rate": base,
        "bias": share / base if share is not None and base else None,  # 1.0 = no position bias
        "per_frame_mean_share": sum(shares) / len(shares) if shares else None,
        "per_frame_max_share": max(shares) if shares else None,
        "per_frame": per_frame,
    }


def position_bias_from_scores(
    visual: VisualTokens,
    scores: Mapping[str, torch.Tensor],  # method name -> [N] scores
    keep_ratio: float = 0.1,
    boundary: float = 0.1,
) -> dict[str, Any]:
    """Top-k (keep_ratio) selection under each method's scores, with boundary statistics for each."""
    topk = TopKSelector.from_options(keep_ratio=keep_ratio)
    edge = boundary_mask(visual, boundary)
    return {
        "keep_ratio": keep_ratio,
        "boundary_fraction": boundary,
        "tokens": visual.n,
        "frames": sum(t for t, _, _ in visual.grids),
        "grids": [list(g) for g in visual.grids],
        "base_rate": _share(int(edge.sum()), visual.n),
        "methods": {
            name: boundary_stats(visual, topk.select(visual, s, None), boundary) for name, s in scores.items()
        },
    }


@torch.inference_mode()
def position_bias(
    pipeline: Any,  # hippo.Pipeline; only its target adapter (and holistic scorer options) are used
    inputs: dict[str, Any],  # processor output for one prompt (batch size 1)
    keep_ratio: float = 0.1,
    *,
    boundary: float = 0.1,
    holistic: HolisticScorer | None = None,  # default: the pipeline's holistic scorer's config, else defaults
) -> dict[str, Any]:
    """Prefill the target once and compare attention-only vs holistic top-k selection (paper Figs. 2, 8).

    Returns position_bias_from_scores(...) for methods "attention" and "holistic".
    """
    adapter = pipeline.target_adapter
    if holistic is None:
        own = getattr(pipeline, "scorer", None)
        holistic = HolisticScorer(own.config) if isinstance(own, HolisticScorer) else HolisticScorer()
    attention = holistic.parts.get("attention") or AttentionScorer()
    encoded = adapter.encode(inputs)
    with attention.observe_target_prefill(adapter, encoded):
        session = adapter.prefill(encoded, keep=None)
    try:
        ctx = ScoringContext(adapter=adapter, encoded=encoded, target=session)
        visual = encoded.visual
        att = attention.score(visual, ctx)
        parts = {n: (att if n == "attention" else p.score(visual, ctx)) for n, p in holistic.parts.items()}
        scores = {"attention": att, "holistic": holistic.fuse(visual, parts)}
    finally:
        session.close()
    out = position_bias_from_scores(visual, scores, keep_ratio, boundary)
    config = attrs.asdict(holistic.config, recurse=False)
    out["holistic_config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()}
    return out


def plot_position_bias(result: Mapping[str, Any], path: str | os.PathLike) -> str:
    """Bar chart (PNG) of the per-frame boundary share of each method against the base rate."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    methods = list(result["methods"])
    F = result["frames"]
    fig = Figure(figsize=(max(6.0, 0.35 * F * max(1, len(methods)) + 2), 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(methods))
    for i, name in enumerate(methods):
        per = result["methods"][name]["per_frame"]
        shares = [100 * (p["boundary_share"] or 0.0) for p in per]
        overall = result["methods"][name]["boundary_share"]
        label = f"{name} (overall {100 * overall:.1f}%)" if overall is not None else name
        ax.bar([f + (i - (len(methods) - 1) / 2) * width for f in range(F)], shares, width, label=label)
    per0 = result["methods"][methods[0]]["per_frame"] if methods else []
    base = [100 * (p["base_rate"] or 0.0) for p in per0]
    if base:
        xs = list(range(F))
        ax.hlines(base, [x - 0.45 for x in xs], [x + 0.45 for x in xs], colors="black", linestyles="--")
        ax.plot([], [], "k--", label="base rate (all tokens)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("frame")
    ax.set_ylabel("boundary tokens among kept (%)")
    ax.set_title(
        f"Position bias: top {100 * result['keep_ratio']:g}% of tokens kept\n"
        f"boundary = top/bottom {100 * result['boundary_fraction']:g}% of rows",
        fontsize="medium",
    )
    ax.set_ylim(0, 100)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    return os.fspath(path)
