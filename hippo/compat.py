"""The name under which this transformers release's model forwards take a KV cache.

transformers 5.24 renamed the forward argument `past_key_values` to `cache`; the old name still
works there with a FutureWarning and is removed in 5.40. hippo supports transformers >= 5.23, so
every call that hands a model its cache spells it `**cache_arg(cache)`.
"""

from __future__ import annotations

import re
from typing import Any

import transformers

#: "cache" from transformers 5.24 on, "past_key_values" before
_RELEASE = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", transformers.__version__).groups())
CACHE_ARG = "cache" if _RELEASE >= (5, 24) else "past_key_values"


def cache_arg(cache: Any) -> dict[str, Any]:
    """{CACHE_ARG: cache}, to pass a KV cache to a model's forward as this release names it."""
    return {CACHE_ARG: cache}
