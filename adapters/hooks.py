"""The two hooks of a module that adds one adapter, built from the adapter class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hippo import hookimpl


def adapter_hooks(adapter: type) -> tuple[Callable[[], dict[str, type]], Callable[[Any], type | None]]:
    """(hippo_register_adapters, hippo_resolve_adapter) for `adapter`: registered under `adapter.name`,
    and chosen for the configs `adapter.matches`. Assign both at module level:

        hippo_register_adapters, hippo_resolve_adapter = adapter_hooks(MyAdapter)
    """

    @hookimpl
    def hippo_register_adapters() -> dict[str, type]:
        return {adapter.name: adapter}

    @hookimpl
    def hippo_resolve_adapter(config: Any) -> type | None:
        return adapter if adapter.matches(config) else None

    return hippo_register_adapters, hippo_resolve_adapter
