"""pluggy hook specifications of the `hippo` project.

A plugin module implements any of these with `@hippo.hookimpl`. The `hippo_register_*` hooks return
a mapping of registry name -> class; the host flattens them and rejects duplicate names.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "hippo"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def hippo_register_scorers() -> dict[str, type]:
    """Return {name: Scorer subclass}."""


@hookspec
def hippo_register_selectors() -> dict[str, type]:
    """Return {name: Selector subclass}."""


@hookspec
def hippo_register_drafters() -> dict[str, type]:
    """Return {name: Drafter subclass}."""


@hookspec
def hippo_register_verifiers() -> dict[str, type]:
    """Return {name: Verifier subclass}."""


@hookspec
def hippo_register_schedulers() -> dict[str, type]:
    """Return {name: Scheduler subclass}."""


@hookspec
def hippo_register_executors() -> dict[str, type]:
    """Return {name: Executor subclass} (where and when the draft runs)."""


@hookspec
def hippo_register_adapters() -> dict[str, type]:
    """Return {name: Adapter subclass}."""


@hookspec(firstresult=True)
def hippo_resolve_adapter(config: Any) -> type | None:
    """Return the Adapter class for a model config (its `model_type` / `architectures`), or None."""


@hookspec(firstresult=True)
def hippo_video_inputs(
    pipeline: Any, path: Any, prompt: str, options: dict[str, Any]
) -> dict[str, Any] | None:
    """Return the target's inputs for `prompt` about the video file at `path`, or None.

    `options` holds `tokenizer`, `frames`, `fps`, `max_pixels` and `progress` (see
    `Pipeline.video_inputs`). hippo's own implementation (`hippo.media`) reads the file with decord
    and builds the inputs with the checkpoint's tokenizer and the adapter's `build_inputs`.
    """
