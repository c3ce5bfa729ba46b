"""pytest parameters over the registries: every adapter, every (adapter, selector, scorer).

Adapters without a tiny model, and combinations an adapter refuses (UnsupportedError), are kept as
skipped params with the reason, so they show in the test report.
"""

from __future__ import annotations

from typing import Any

import pytest

from hippo.testing.models import names, selector_scorer_pairs, tiny
from hippo.testing.reference import unsupported


def adapter_params() -> list[Any]:
    """Every registered adapter as a pytest param; those without a tiny model are marked skip."""
    out = []
    for name in names("adapters"):
        try:
            tiny(name)
            out.append(pytest.param(name, id=name))
        except NotImplementedError as exc:
            out.append(pytest.param(name, id=name, marks=pytest.mark.skip(reason=f"no tiny model: {exc}")))
    return out


def combination_params() -> list[Any]:
    """(adapter, selector, scorer) for every adapter with a tiny model and every pair; refused
    combinations are marked skip with the adapter's reason."""
    out = []
    for param in adapter_params():
        (adapter,) = param.values
        for sel, sc in selector_scorer_pairs():
            pid = f"{adapter}-{sel}-{sc}"
            if param.marks:
                out.append(pytest.param(adapter, sel, sc, id=pid, marks=param.marks))
            elif (why := unsupported(adapter, sel, sc)) is not None:
                out.append(pytest.param(adapter, sel, sc, id=pid, marks=pytest.mark.skip(reason=why)))
            else:
                out.append(pytest.param(adapter, sel, sc, id=pid))
    return out
