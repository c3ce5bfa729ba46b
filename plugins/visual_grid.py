"""Helpers shared by the scorers and selectors: video/frame layout, budgets, score checks, validators.

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


# ---- attrs validators ----------------------------------------------------------------------


def one_of(*choices: str):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise ValueError(
                f"{attribute.name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
            )

    return check


def number_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        ok = not isinstance(value, bool) and isinstance(value, (int, float))
        if ok:
            ok = (value > low if low_open else value >= low) and (
                value < high if high_open else value <= high
            )
        if not ok:
            lb, hb = "(" if low_open else "[", ")" if high_open else "]"
            raise ValueError(f"{attribute.name} must be a number in {lb}{low}, {high}{hb}, got {value!r}")

    return check


def positive_number(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{attribute.name} must be a number > 0, got {value!r}")


def optional_int_tuple(value: Any) -> tuple[int, ...] | None:
    """Converter: None, an int, or a list of ints -> None or a tuple (JSON/TOML configs give lists)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value  # left for the validator to reject


def layer_indices(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if (
        not isinstance(value, tuple)
        or not value
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise ValueError(
            f"{attribute.name} must be None (all layers) or a non-empty list of layer indices "
            f"(negative counts from the end), got {value!r}"
        )
