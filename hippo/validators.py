"""attrs validators (and one converter) shared by the configs of the plugins."""

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
