"""Grouped-query attention for hippo's few-token forwards on a CPU: the g query heads of each key/value
head packed into one head of g·k rows, so torch's kernel reads every cached key and value once.

A step or a verification feeds k tokens (1 to γ+1, or a batch's rows of them) against a long cache.
transformers' SDPA path hands torch the H = g·KVH query heads of a grouped-query model either with
the cache's K/V copied once per query head (`repeat_kv`, under a mask) or with `enable_gqa`, where
torch's CPU flash kernel still walks the cache once per query head. Packing instead gives the kernel
KVH heads of g·k query rows each (transformers does the same for one masked token, `pack_gqa`):
the same attention, the cache read once, and wider GEMMs in the kernel. Measured on the long-video
target (16 query / 8 KV heads of 64, 4 layers; 2-core AMD EPYC, AVX2, alternated in one process), a
step / a 6-token verification: 33.8 / 55.9 ms through transformers' path, 28.8 / 45.5 ms packed
after an 8,218-token video prompt, 58.6 / 106.5 against 46.7 / 82.3 ms after 16,390 tokens, and the
same after 586 (its logits within 5e-6 of the first, as a k-token verification's already are of a
one-token step's; the float64 harness, where packing runs too, proves the schedules exact).

`grouped_query_sdpa(device)` turns packing on for the calling thread (CPU only) around hippo's session
forwards. The first entry registers `packed_sdpa` as transformers' "sdpa" attention function
(`transformers.AttentionInterface`, its documented extension point); outside the context, on another
thread, under `torch.compile` and for anything it does not pack (one head per group, dropout, a
position bias, per-head masks, a causal prefill without a mask) it calls the function it replaced,
with the same arguments: every other forward in the process runs as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

_ROUTE = threading.local()  # .on: pack this thread's attention
_LOCK = threading.Lock()
_STOCK: Callable[..., Any] | None = None  # the "sdpa" function packed_sdpa replaced
#: keyword arguments that change what SDPA computes: attention with any of them set is not packed
_UNPACKED_KWARGS = ("position_bias", "softcap", "s_aux", "sinks", "output_attentions")


@contextlib.contextmanager
def grouped_query_sdpa(device: torch.device) -> Iterator[None]:
    """Pack grouped query heads in this thread's attention, on a CPU (see the module doc)."""
    if device.type != "cpu":
        yield
        return
    install()
    before = getattr(_ROUTE, "on", False)
    _ROUTE.on = True
    try:
        yield
    finally:
        _ROUTE.on = before


def install() -> None:
    """Register `packed_sdpa` as transformers' "sdpa" attention function (once per process)."""
    global _STOCK
    if _STOCK is not None:  # every forward enters here: no lock once installed
        return
    from transformers import AttentionInterface

    with _LOCK:
        if _STOCK is None:
            _STOCK = AttentionInterface._global_mapping["sdpa"]
            AttentionInterface.register("sdpa", packed_sdpa)


def _given(value: Any) -> bool:
    return value is not None and value is not False


def packs(
    module: Any,
    query: torch.Tensor,  # [B, H, k, D]
    key: torch.Tensor,  # [B, KVH, N, D]
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict,
) -> bool:
    """Whether `packed_sdpa` packs this call (it is routed here and packing computes the same)."""
    if not getattr(_ROUTE, "on", False) or torch.compiler.is_compiling() or query.device.type != "cpu":
        return False
    g = getattr(module, "num_key_value_groups", 1)
    if (
        g <= 1
        or key.shape[1] * g != query.shape[1]
        or dropout
        or any(_given(kwargs.get(k)) for k in _UNPACKED_KWARGS)
    ):
        return False
    if attention_mask is None:
        return query.shape[2] == 1  # more tokens without a mask: a causal prefill
    return (
        attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and attention_mask.shape[2] == query.shape[2]
    )


def packed_sdpa(
    module: Any,
    query: torch.Tensor,  # [B, H, k, D], H = g * KVH (head h reads KV head h // g)
    key: torch.Tensor,  # [B, KVH, N, D]
    value: torch.Tensor,  # [B, KVH, N, D]
    attention_mask: torch.Tensor | None,  # [B or 1, 1, k, N] bool or additive, or None (k = 1)
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # -> ([B, k, H, D], None), as transformers' attention functions return
    if not packs(module, query, key, attention_mask, dropout, kwargs):
        return _STOCK(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    B, H, k, D = query.shape
    g = module.num_key_value_groups
    rows = query.reshape(B, H // g, g * k, D)  # row j*k + i: the group's j-th query head, token i
    mask = None if attention_mask is None else attention_mask.repeat(1, 1, g, 1)  # [B, 1, g*k, N]
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)  # [B, KVH, g*k, D]
    return out.reshape(B, H, k, -1).transpose(1, 2).contiguous(), None
