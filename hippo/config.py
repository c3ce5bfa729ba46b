"""attrs validators shared by the configs of plugins and of the pipeline."""

from __future__ import annotations

from typing import Any

import attrs


def keep_ratio(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name} must be a number in (0, 1], got {value!r}")


def positive_int(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer >= 1, got {value!r}")


def gamma_option(instance: Any, attribute: attrs.Attribute, value: int | str) -> None:
    """A draft length γ >= 1, or "auto" (chosen each round by the cost model, `hippo.cost`)."""
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{attribute.name} must be an integer >= 1, got {value!r} (or "auto")')


def optional_seed(instance: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{attribute.name} must be None or an integer >= 0, got {value!r}")


def budget(n: int, ratio: float) -> int:
    """Number of visual tokens kept out of n at a keep ratio (at least one when n > 0)."""
    return 0 if n == 0 else min(n, max(1, round(n * ratio)))
