"""The KV cache hippo's sessions run on: transformers' `DynamicCache`, with slab-backed layers.

transformers' `DynamicLayer` appends a forward's keys and values with `torch.cat`, which copies the
whole cache on every forward. A video prompt makes that cache long, and speculative decoding runs
many short forwards on it. For the narration target (4 layers, 8 K/V heads, a 587-token prompt) that
was 0.9 ms of a 12 ms step; at batch 8, 10-17 ms of a 21-26 ms verification.

`SlabLayer` is a `DynamicLayer` that keeps its keys and values in a pre-allocated slab
[B, H, capacity, D] and shows the used prefix as a view (`keys = slab[:, :, :n]`). An append writes
into the slab in place; a crop is a shorter view, and the next append writes over what it dropped.
When the slab is full, or when someone rebound `keys`/`values` to another tensor (an `index_select`
by a batch, a tree's kept rows), the next append moves the entries into a new slab with room to
spare: one copy, as `cat` made every time. The attention reads the same values either way.

A fork (`fork_cache`, a video context answering several questions) shares the slab. Neither side
then writes into it again: each copies its entries into a slab of its own at its next append.

A batch (`hippo.stacked.BatchedCache`) shows its live rows as a prefix on the batch dimension too
(`keys = slab[:B, :, :n]`), with spare rows as well as spare slots: a row joins by writing its cache
into the next spare row (`stack`), and rows leave by moving the kept ones to the front in place
(`keep_batch`). So a join copies the joining row's cache only, where `torch.cat` (or `index_select`,
for rows leaving) copied every live row's, and the next append moved them all into a new slab again.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from hippo.errors import UnsupportedError

#: spare slots a new slab gets beyond what it must hold: a quarter more, and at least this many
MIN_ROOM = 128


class SlabLayer(DynamicLayer):
    """A `DynamicLayer` whose appends write into a pre-allocated slab (see the module's doc)."""

    def __init__(self, reserve: int = 0, **kwargs: Any):
        super().__init__(**kwargs)
        self.slabs: tuple[torch.Tensor, torch.Tensor] | None = None  # ([B, H, C, D], [B, H, C, D])
        #: a slab for at most this many entries holds exactly this many (a prefill of known length)
        self.reserve = reserve

    def update(
        self,
        key_states: torch.Tensor,  # [B, H, k, D]
        value_states: torch.Tensor,  # [B, H, k, D]
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # -> keys, values [B, H, n + k, D]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, (B, k) = self.get_seq_length(), (key_states.shape[0], key_states.shape[-2])
        if not self._writable(n + k, key_states):
            self._new_slabs(n, n + k, key_states, value_states)
        ks, vs = self.slabs
        ks[:B, :, n : n + k].copy_(key_states)
        vs[:B, :, n : n + k].copy_(value_states)
        self.keys, self.values = ks[:B, :, : n + k], vs[:B, :, : n + k]
        return self.keys, self.values

    def _writable(self, need: int, like: torch.Tensor) -> bool:
        """Whether `keys`/`values` are still prefixes of this layer's own slabs, with room for `need`."""
        return self._room(like.shape[0], need, like)

    def _room(self, rows: int, slots: int, like: torch.Tensor) -> bool:
        """Whether `keys`/`values` are still prefixes of this layer's own slabs, which have room for
        `rows` rows of `slots` slots of tensors like `like` ([B, H, k, D])."""
        if self.slabs is None:
            return False
        ks, vs = self.slabs
        if ks.shape[0] < rows or ks.shape[2] < slots or ks.shape[1] != like.shape[1]:
            return False
        if ks.shape[3] != like.shape[3] or ks.dtype != like.dtype or ks.device != like.device:
            return False
        if ks.is_inference() and not torch.is_inference_mode_enabled():
            return False  # an inference tensor takes no in-place write outside inference mode
        return _prefix(self.keys, ks) and _prefix(self.values, vs)

    def _new_slabs(
        self, n: int, need: int, key_states: torch.Tensor, value_states: torch.Tensor, rows: int = 0
    ) -> None:
        """New slabs for `need` slots (and at least `rows` rows), the first n slots of the live rows
        copied in; a batch's spare rows are kept."""
        capacity = self.reserve if need <= self.reserve else need + max(MIN_ROOM, need // 4)
        rows = max(rows, key_states.shape[0], self.slabs[0].shape[0] if self.slabs is not None else 0)
        slabs = []
        for old, new in ((self.keys, key_states), (self.values, value_states)):
            _, H, _, D = new.shape
            slab = new.new_empty(rows, H, capacity, D)  # [R, H, C, D]
            if n:
                slab[: old.shape[0], :, :n].copy_(old)
            slabs.append(slab)
        self.slabs = (slabs[0], slabs[1])

    def stack(self, live: int, rows: list[tuple[torch.Tensor, torch.Tensor]], size: int) -> None:
        """Add batch rows after the first `live` ones: `rows` are batch-1 (keys, values), each
        [1, H, n_i, D], written into the slab's next spare rows; every row is padded with zeros to
        `size` slots (≥ the live rows' and each n_i). Without room, one new slab with spare rows (half
        the live ones) and spare slots takes the live rows first (one copy, as `torch.cat` made)."""
        B, (key, _) = live + len(rows), rows[0]
        old = self.keys.shape[2] if live else 0
        self.reserve = 0  # a prefill's exact fit: the batch grows past it
        if not (self._room(B, size, key) and (live == 0 or self.keys.shape[0] == live)):
            self._new_slabs(old, size, key, rows[0][1], rows=B + live // 2)
        ks, vs = self.slabs  # [R, H, C, D]
        for slab in (ks, vs):
            slab[:live, :, old:size].zero_()  # the live rows' new padding
        for b, (k, v) in enumerate(rows, start=live):
            n = k.shape[2]
            for slab, src in ((ks, k), (vs, v)):
                if src.data_ptr() != slab[b : b + 1].data_ptr():  # not the row's own slab already
                    slab[b, :, :n].copy_(src[0])
                slab[b, :, n:size].zero_()
        self.keys, self.values = ks[:B, :, :size], vs[:B, :, :size]

    def keep_batch(self, rows: list[int]) -> bool:
        """Keep the batch rows `rows`, in that order, moved to the front of the slab in place (the rows
        before the first one that moves stay where they are). False, with nothing done, where the
        keys are not this layer's slabs' (the caller then gathers them itself)."""
        if not self._room(self.keys.shape[0], self.keys.shape[2], self.keys):
            return False
        (ks, vs), n, k = self.slabs, self.keys.shape[2], len(rows)
        first = next((j for j, r in enumerate(rows) if r != j), k)
        if first < k:
            idx = torch.as_tensor(rows[first:], dtype=torch.long, device=ks.device)
            for slab in (ks, vs):
                slab[first:k, :, :n] = slab[:, :, :n].index_select(0, idx)  # gathered, then written
        self.keys, self.values = ks[:k, :, :n], vs[:k, :, :n]
        return True

    def disown(self) -> None:
        """Stop writing into the current slabs (another layer shares them): copy at the next append."""
        self.slabs = None

    def reset(self) -> None:
        self.slabs = None
        super().reset()

    def keep_rows(self, past: int, rows: torch.Tensor) -> None:  # rows [r] long: block rows, in order
        """Keep the first `past` entries and then the entries past + rows (a token tree's kept path)."""
        r = int(rows.shape[0])
        src = (past + rows).to(self.keys.device)
        if self._writable(past + r, self.keys):
            for view in (self.keys, self.values):  # [B, H, n, D]
                view[:, :, past : past + r] = view[:, :, src]  # the gather copies first
            self.keys, self.values = self.keys[:, :, : past + r], self.values[:, :, : past + r]
        else:
            _keep_copied(self, past, src)


def _prefix(view: torch.Tensor | None, slab: torch.Tensor) -> bool:
    """Whether `view` is slab[:B, :, :n] for some B and n."""
    return (
        view is not None
        and view.dim() == 4
        and view.data_ptr() == slab.data_ptr()
        and view.stride() == slab.stride()
        and view.shape[0] <= slab.shape[0]
        and view.shape[1] == slab.shape[1]
        and view.shape[3] == slab.shape[3]
    )


def _keep_copied(layer: Any, past: int, src: torch.Tensor) -> None:
    index = torch.cat([torch.arange(past, device=src.device), src])  # [past + r]
    layer.keys = layer.keys.index_select(-2, index)  # [B, H, past + r, D]
    layer.values = layer.values.index_select(-2, index)


def slab_cache(config: Any, reserve: int = 0) -> Any:
    """A transformers `DynamicCache` for `config`, its full-attention layers `SlabLayer`s (sliding
    and other layer kinds stay as transformers makes them). `reserve`: the entries a prefill of known
    length will write (in one forward or in pieces): its slab holds exactly them, allocated once,
    so `fit_cache` keeps it as it is and the prefill's peak memory holds one copy of the KV."""
    cache = DynamicCache(config=config)
    cache.layers = [SlabLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def keep_rows(cache: Any, past: int, rows: torch.Tensor) -> None:  # rows [r] long: block rows, in order
    """Keep each layer's first `past` entries and then the entries past + rows (drop the others)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        if isinstance(layer, SlabLayer):
            layer.keep_rows(past, rows)
        else:
            _keep_copied(layer, past, (past + rows).to(layer.keys.device))


def fit_cache(cache: Any) -> Any:
    """`cache`, its slab layers holding their entries only (one copy each, no spare slots): for a
    cache that is kept and forked, not grown (a video context's prefix). Returns `cache`."""
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, SlabLayer) and layer.slabs is not None:
            if layer.keys.shape[::2] != layer.slabs[0].shape[::2]:  # spare rows or slots: copy out
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            layer.disown()
    return cache


def fork_cache(cache: Any) -> Any:
    """A copy-on-write view of a transformers `DynamicCache`: it shares the tensors of `cache`.

    Dynamic layers grow by `torch.cat` and shrink by slicing, which rebind new tensors on the fork's
    own layer objects; slab layers, on both sides, copy into a slab of their own before their next
    write. So the original's entries stay exactly as they were.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise UnsupportedError("a video context needs a transformers Cache with `.layers` (DynamicCache)")
    for layer in layers:
        if isinstance(layer, SlabLayer):
            layer.disown()
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in layers]
    return out
