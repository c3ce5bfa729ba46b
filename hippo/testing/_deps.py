"""hypothesis is an optional dependency of hippo: `pip install 'hippo[testing]'`."""

from __future__ import annotations

from hippo.errors import HippoError


class MissingTestingDependency(HippoError, ImportError):
    """hippo.testing was used without its extra dependencies installed."""


def require_hypothesis() -> None:
    try:
        import hypothesis  # noqa: F401
    except ImportError as exc:
        raise MissingTestingDependency(
            "hippo.testing needs the hypothesis package, which is not installed; install it with "
            "pip install 'hippo[testing]' (or pip install hypothesis)"
        ) from exc
