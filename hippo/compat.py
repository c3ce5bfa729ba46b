"""Where hippo meets details of the installed transformers release.

- The name under which a model's forward takes a KV cache: transformers 5.24 renamed the forward
  argument `past_key_values` to `cache`; the old name still works there with a FutureWarning and is
  removed in 5.40. hippo supports transformers >= 5.23, so every call that hands a model its cache
  spells it `**cache_arg(cache)`.
- The output-capturing hooks a model's first forward installs (`transformers.utils.output_capturing`):
  local functions, which cannot be pickled, so a model that has run cannot be sent to a draft
  process until they are taken off (`drop_output_capturing_hooks`). transformers installs them again
  at the model's next forward, from what each model class registered when a model of it was built;
  in a process that only unpickled the model, `register_output_capturing` registers it.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import transformers

#: "cache" from transformers 5.24 on, "past_key_values" before
_RELEASE = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", transformers.__version__).groups())
CACHE_ARG = "cache" if _RELEASE >= (5, 24) else "past_key_values"


def cache_arg(cache: Any) -> dict[str, Any]:
    """{CACHE_ARG: cache}, to pass a KV cache to a model's forward as this release names it."""
    return {CACHE_ARG: cache}


_CAPTURING = "transformers.utils.output_capturing"


def drop_output_capturing_hooks(model: torch.nn.Module) -> None:
    """Take transformers' output-capturing forward hooks off `model` (and mark it unhooked, so its
    next forward installs them again): the model then pickles, e.g. to a spawned draft process."""
    for module in model.modules():
        for hook_id, fn in list(module._forward_hooks.items()):
            if getattr(fn, "__module__", None) == _CAPTURING:
                del module._forward_hooks[hook_id]
                module._forward_hooks_with_kwargs.pop(hook_id, None)
                module._forward_hooks_always_called.pop(hook_id, None)
        if getattr(module, "_output_capturing_hooks_installed", False):
            module._output_capturing_hooks_installed = False


def register_output_capturing(model: torch.nn.Module) -> None:
    """Register the outputs each part of `model` can capture (hidden states, ...) in this process, as
    building the model does: an unpickled model (in a draft process) has not been built here."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    for module in model.modules():
        can_record = getattr(module, "_can_record_outputs", None)
        if can_record:
            _CAN_RECORD_REGISTRY[module] = can_record
