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

A long cache read by fewer (batch row, KV head) pairs than torch has threads (one video's row, one
KV head) leaves torch's CPU kernel on one thread: it splits its work by batch, head and query block,
and a few packed query rows are one block. So such a cache is split across the threads instead
(`split_kv_sdpa`, flash-decoding): each thread attends to one stretch of the cache and the stretches'
outputs are summed by their log-sum-exp. Measured on the long-video pair's target (8 query / 1 KV
head of 64, 8,214 cached tokens; 2-core AMD EPYC, AVX-512), one layer's attention of a step / a
6-token verification: 338 / 882 us whole, 162 / 677 us split in two (48 query rows are two blocks
of 32 and 16 rows, so even they leave a thread half idle). A whole forward of that target at 8,218
cached tokens, split against whole, interleaved in one process (four runs): a step 0.85-0.96x, a
4-token verification 0.79-0.92x, a 6-token one 0.97-0.98x.

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
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

_ROUTE = threading.local()  # .on: pack this thread's attention
_LOCK = threading.Lock()
_STOCK: Callable[..., Any] | None = None  # the "sdpa" function packed_sdpa replaced
#: keyword arguments that change what SDPA computes: attention with any of them set is not packed
_UNPACKED_KWARGS = ("position_bias", "softcap", "s_aux", "sinks", "output_attentions")
#: a cache at least this long, read by fewer (batch row, KV head) pairs than torch has threads, is
#: split across the threads (`split_kv_sdpa`)
SPLIT_KV_MIN = 2048
#: torch's CPU flash attention with each query row's log-sum-exp (None where this torch lacks it)
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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
    if splits(rows, key):
        masks = _forward_masks(attention_mask, g, g * k, key.shape[2], query.dtype)
        out = split_kv_sdpa(rows, key, value, None, scaling, masks=masks)
    else:
        mask = None if attention_mask is None else attention_mask.repeat(1, 1, g, 1)  # [B, 1, g*k, N]
        out = F.scaled_dot_product_attention(
            rows, key, value, attn_mask=mask, scale=scaling
        )  # [B, KVH, g*k, D]
    return out.reshape(B, H, k, -1).transpose(1, 2).contiguous(), None


def splits(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `packed_sdpa` splits this cache across torch's threads (the module doc): a long one,
    read by fewer (batch row, KV head) pairs than torch's threads."""
    B, KVH = query.shape[:2]
    return (
        _FLASH_LSE is not None
        and key.shape[2] >= max(SPLIT_KV_MIN, 2)
        and B * KVH < torch.get_num_threads()
        and key.stride(-1) == 1
        and key.dtype in (torch.float32, torch.float64, torch.bfloat16)
    )


def _stretches(x: torch.Tensor, c: int, step: int, n: int) -> torch.Tensor:  # [N, D] -> [c, 1, n, D]
    """`c` views of `n` rows of `x`, starting `step` rows apart (no copy)."""
    return x.as_strided(
        (c, 1, n, x.shape[1]), (step * x.stride(0), n * x.stride(0), *x.stride()), x.storage_offset()
    )


def _layout(N: int) -> tuple[int, int, int]:
    """(c, step, n): one stretch per thread (at most N), `step` >= 1 apart, the last ending at N
    (`split_kv_sdpa`). Each but the last hides its last n - step tokens, which the next one holds; its
    first `step` stay visible, so that alone hides no stretch whole."""
    c = min(torch.get_num_threads(), N)
    step = N // c
    return c, step, N - (c - 1) * step


StretchMasks = list[tuple[torch.Tensor | None, torch.Tensor | None]]


def stretch_masks(mask: torch.Tensor | None, N: int, R: int, dtype: torch.dtype) -> StretchMasks:
    """Per batch row of `mask` ([B or 1, 1, R, N] bool or additive, or None): its stretches'
    additive mask [c, 1, R, n] (None: nothing hidden) and the [c, 1, R] rows a stretch hides whole
    (None: none)."""
    c, step, n = _layout(N)
    out: StretchMasks = []
    for b in range(1 if mask is None else mask.shape[0]):
        hide = None
        if mask is not None:
            m = mask[b, 0]  # [R, N]
            if m.dtype == torch.bool:
                m = torch.zeros(m.shape, dtype=dtype).masked_fill_(~m, float("-inf"))
            m = m.to(dtype)
            hide = m.as_strided((c, 1, R, n), (step * m.stride(1), 0, *m.stride()), m.storage_offset())
        if n > step:  # each stretch but the last hides the tokens the next one holds too
            hide = torch.zeros(c, 1, R, n, dtype=dtype) if hide is None else hide.clone()
            hide[:-1, :, :, step:] = float("-inf")
        out.append((hide, None if mask is None else ~(hide > float("-inf")).any(-1)))
    return out


def _forward_masks(
    attention_mask: torch.Tensor | None, g: int, R: int, N: int, dtype: torch.dtype
) -> StretchMasks:
    """`stretch_masks` of `attention_mask` repeated for the g packed query heads (R = g·k rows), made
    once per forward: transformers hands every layer the same mask tensor, made anew for each
    forward, so the last one is kept for the next layer of this thread's forward (by identity: a weak
    reference, dead once that forward's mask is freed; no mask: by the shapes alone)."""
    key = (g, R, N, dtype, torch.get_num_threads())
    kept = getattr(_ROUTE, "masks", None)
    if kept is not None:
        ref, kept_key, masks = kept
        if kept_key == key and (
            ref is None if attention_mask is None else ref is not None and ref() is attention_mask
        ):
            return masks
    mask = None if attention_mask is None else attention_mask.repeat(1, 1, g, 1)  # [B, 1, R, N]
    masks = stretch_masks(mask, N, R, dtype)
    _ROUTE.masks = (None if attention_mask is None else weakref.ref(attention_mask), key, masks)
    return masks


def split_kv_sdpa(
    query: torch.Tensor,  # [B, KVH, R, D]: one query head per KV head (packed)
    key: torch.Tensor,  # [B, KVH, N, D]
    value: torch.Tensor,  # [B, KVH, N, D]
    mask: torch.Tensor | None,  # [B or 1, 1, R, N] bool or additive, or None
    scale: float | None,
    masks: StretchMasks | None = None,
) -> torch.Tensor:  # [B, KVH, R, D]
    """SDPA with the cache cut into one stretch per thread (flash-decoding): stretch c holds cached
    tokens [c·step, c·step + n), n = N - (C-1)·step with step = N // C, so the last stretch ends at N
    and each other one overlaps the next by N mod C tokens, which it hides. Each stretch's output is
    weighted by softmax over the stretches of its log-sum-exp; a stretch whose tokens the mask hides
    from a query row counts for nothing there (torch's kernel gives such a row 0, not -inf).
    `masks`: `stretch_masks` of the mask, made already (then `mask` is not read)."""
    B, KVH, R, D = query.shape
    N = key.shape[2]
    c, step, n = _layout(N)
    if masks is None:
        masks = stretch_masks(mask, N, R, query.dtype)
    out = torch.empty_like(query)
    for b in range(B):
        hide, blind = masks[b if len(masks) > 1 else 0]
        for h in range(KVH):
            q = query[b, h][None, None].expand(c, 1, R, D)
            k, v = _stretches(key[b, h], c, step, n), _stretches(value[b, h], c, step, n)
            o, lse = _FLASH_LSE(q, k, v, attn_mask=hide, scale=scale)  # o [c, 1, R, D], lse [c, 1, R]
            if blind is not None:
                lse = lse.masked_fill(blind, float("-inf"))
            out[b, h] = (o * torch.softmax(lse, 0).unsqueeze(-1)).sum(0)[0]
    return out
