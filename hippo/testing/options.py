"""Process-wide defaults of the checks, set by the pytest plugin's `--hippo-examples`."""

from __future__ import annotations

_EXAMPLES: int | None = None


def set_default_examples(n: int | None) -> None:
    """Examples per check when a check is not given `examples=` (None: the hypothesis profile's)."""
    global _EXAMPLES
    _EXAMPLES = None if n is None else max(1, int(n))


def default_examples() -> int:
    if _EXAMPLES is not None:
        return _EXAMPLES
    from hypothesis import settings

    return settings().max_examples
