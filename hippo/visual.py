"""The visual sequence's layout for scorers and selectors: videos and frames, budgets, score checks.

Visual tokens are laid out video after video, frame after frame, row-major inside a frame
(`VisualTokens.grids` gives each video's (t, h, w)). Nothing here ever crosses a video boundary
unless it says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import torch

from hippo.errors import ConfigError, InputError
from hippo.types import VisualTokens


@attrs.frozen
class Video:
    """One video's block of the visual sequence: tokens start .. start + t*h*w."""

    start: int
    t: int
    h: int
    w: int

    @property
    def frame_size(self) -> int:
        return self.h * self.w

    @property
    def stop(self) -> int:
        return self.start + self.t * self.h * self.w


def keep_ratio_of(selector: Any) -> float | None:
    """The share of the visual tokens a selector keeps, where its config has one (`keep_ratio`)."""
    ratio = getattr(getattr(selector, "config", None), "keep_ratio", None)
    return None if ratio is None else float(ratio)


def with_keep_ratio(selector: Any, ratio: float) -> Any:
    """The selector keeping `ratio` of the tokens instead (the `auto` schedule's keep-ratio planner),
    or None where its config has no `keep_ratio`."""
    if keep_ratio_of(selector) is None:
        return None
    return type(selector)(attrs.evolve(selector.config, keep_ratio=ratio))


def budget(n: int, ratio: float) -> int:
    """Number of visual tokens kept out of n at a keep ratio (at least one when n > 0)."""
    return 0 if n == 0 else min(n, max(1, round(n * ratio)))


def videos(visual: VisualTokens) -> Iterator[Video]:
    start = 0
    for t, h, w in visual.grids:
        yield Video(start, t, h, w)
        start += t * h * w


def frame_sizes(visual: VisualTokens) -> torch.Tensor:  # -> [F] long, tokens per frame in order
    sizes = [h * w for t, h, w in visual.grids for _ in range(t)]
    return torch.tensor(sizes, dtype=torch.long)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def frames_per_chunk(frame_size: int, chunk_tokens: int) -> int:
    return max(1, chunk_tokens // max(1, frame_size))


def apportion(total: int, sizes: torch.Tensor) -> torch.Tensor:  # sizes [G] -> [G] long, sums to total
    """Split `total` over groups proportionally to `sizes` (largest remainder; ties to the earlier group).

    Requires 0 <= total <= sizes.sum(); no group gets more than its size.
    """
    sizes = sizes.to(torch.long)
    n = int(sizes.sum())
    if not 0 <= total <= n:
        raise ValueError(f"cannot apportion {total} over groups of {n} tokens")
    if n == 0:
        return torch.zeros_like(sizes)
    exact = sizes.to(torch.float64) * total / n
    base = exact.floor().long()
    left = total - int(base.sum())
    if left:
        frac = exact - base
        order = torch.sort(-frac, stable=True).indices
        base[order[:left]] += 1
    return base


def linspace_pick(n: int, k: int) -> torch.Tensor:  # -> [k] long, ascending unique in [0, n)
    """k evenly spaced indices over range(n), first and last included (SpecVLM's uniform fill)."""
    if k <= 0 or n <= 0:
        return torch.zeros(0, dtype=torch.long)
    if k >= n:
        return torch.arange(n)
    # spacing (n-1)/(k-1) >= 1, so the rounded values are strictly increasing
    return torch.linspace(0, n - 1, k, dtype=torch.float64).round().long()


def check_scores(visual: VisualTokens, scores: torch.Tensor | None, owner: str) -> torch.Tensor:
    """Validate a scorer's output for a selector and return it as a CPU float64 vector [N]."""
    if scores is None:
        raise ConfigError(
            f"selector {owner!r} ranks tokens by score but got none: add a scorer, e.g. .scorer('holistic')"
        )
    if scores.dim() != 1 or scores.shape[0] != visual.n:
        raise InputError(
            f"selector {owner!r} got scores of shape {tuple(scores.shape)} for {visual.n} visual tokens; "
            "a scorer must return one score per visual token"
        )
    out = scores.detach().to("cpu", torch.float64)
    if bool(torch.isnan(out).any()):
        raise InputError(
            f"selector {owner!r} got NaN scores; check the scorer (a constant frame must give 0)"
        )
    return out


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:  # scores [n] -> [k] long, unsorted
    """Indices of the k highest scores; ties go to the earlier token (deterministic)."""
    return torch.sort(scores, descending=True, stable=True).indices[:k]
