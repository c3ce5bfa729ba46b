"""Slab-backed cache layers hold exactly what transformers' `DynamicLayer` holds, under any sequence
of appends, crops, rebinds, kept tree rows and forks (the fork and the original never see each
other's later writes)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer

from hippo.interfaces import ModelSession, catch_up, common_prefix
from hippo.kvcache import MIN_ROOM, SlabLayer, fit_cache, fork_cache, keep_rows, slab_cache
from hippo.testing import models as hm

B, H, D = 2, 3, 4

ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 90)),
        st.tuples(st.just("crop"), st.integers(1, 40)),
        st.tuples(st.just("rebind"), st.just(0)),
        st.tuples(st.just("keep"), st.integers(0, 2**16)),
        st.tuples(st.just("fork"), st.integers(0, 1)),
        st.tuples(st.just("outside inference mode"), st.integers(1, 5)),
    ),
    min_size=1,
    max_size=25,
)


class _Cache:  # the minimal Cache shape that fork_cache / keep_rows read: `.layers`
    def __init__(self, layer):
        self.layers = [layer]


def _append(layer, k: int, seed: int, inference: bool = True) -> None:
    g = torch.Generator().manual_seed(seed)
    key, value = torch.randn(B, H, k, D, generator=g), torch.randn(B, H, k, D, generator=g)
    with torch.inference_mode(inference):
        layer.update(key, value)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_slab_layer_holds_what_a_dynamic_layer_holds(steps):
    pairs = [(_Cache(SlabLayer()), _Cache(DynamicLayer()))]  # every live (slab, reference) pair
    _append(pairs[0][0].layers[0], 5, 0)
    _append(pairs[0][1].layers[0], 5, 0)
    for i, (op, arg) in enumerate(steps):
        slab, ref = pairs[i % len(pairs)]
        s, r = slab.layers[0], ref.layers[0]
        n = r.get_seq_length()
        if op == "append":
            _append(s, arg, i)
            _append(r, arg, i)
        elif op == "outside inference mode":
            _append(s, arg, i, inference=False)
            _append(r, arg, i, inference=False)
        elif op == "crop" and arg < n:
            s.crop(-arg)
            r.crop(-arg)
        elif op == "rebind":  # someone else's gather (a batch's compaction): new tensors, reordered
            for layer in (s, r):
                layer.keys, layer.values = layer.keys.flip(2), layer.values.flip(2)
        elif op == "keep" and n > 1:  # a token tree: keep some of the last block's rows
            past = n - 1 - arg % min(n - 1, 8)
            block = n - past
            rows = torch.tensor(sorted({(arg >> j) % block for j in range(4)}), dtype=torch.long)
            with torch.inference_mode():
                keep_rows(slab, past, rows)
                keep_rows(ref, past, rows)
        elif op == "fork":
            pairs.append((fork_cache(slab), fork_cache(ref)))
        for a, b in pairs:
            assert torch.equal(a.layers[0].keys, b.layers[0].keys)
            assert torch.equal(a.layers[0].values, b.layers[0].values)


def test_appends_write_in_place_and_a_crop_reuses_the_slab():
    layer = SlabLayer()
    _append(layer, 10, 0)
    slab = layer.slabs[0]
    assert slab.shape[2] == 10 + MIN_ROOM
    for i in range(5):
        _append(layer, 3, i + 1)
        layer.crop(-1)
    assert layer.slabs[0] is slab and layer.get_seq_length() == 20
    _append(layer, MIN_ROOM, 9)  # past the room: one new slab, a quarter larger than needed
    assert layer.slabs[0] is not slab and layer.slabs[0].shape[2] == 148 + MIN_ROOM


def test_a_kept_cache_holds_no_spare_slots_and_slab_caches_replace_full_attention_layers():
    cache = slab_cache(hm.tiny("qwen2_5_vl").config)
    assert cache.layers and all(type(layer) is SlabLayer for layer in cache.layers)
    layer = cache.layers[0]
    _append(layer, 7, 0)
    keys = layer.keys.clone()
    fit_cache(cache)
    assert layer.slabs is None and layer.keys.is_contiguous() and torch.equal(layer.keys, keys)
    assert layer.keys.untyped_storage().nbytes() == keys.numel() * keys.element_size()


def test_a_prefill_of_known_length_allocates_its_slab_once_and_is_kept_without_a_copy():
    """`slab_cache(config, reserve=L)`: a prefill of L entries, in pieces, writes into one slab of
    exactly L; `fit_cache` keeps that slab (no second copy of the KV at the prefill's peak), and a
    fork of it still copies before it grows, leaving the kept entries as they were."""
    cache = slab_cache(hm.tiny("qwen2_5_vl").config, reserve=12)
    layer = cache.layers[0]
    _append(layer, 5, 0)
    slab = layer.slabs[0]
    assert slab.shape[2] == 12
    _append(layer, 7, 1)
    assert layer.slabs[0] is slab
    keys, pointer = layer.keys.clone(), layer.keys.data_ptr()
    fit_cache(cache)
    assert layer.slabs is None and layer.keys.data_ptr() == pointer and torch.equal(layer.keys, keys)
    assert layer.keys.is_contiguous()
    assert layer.keys.untyped_storage().nbytes() == keys.numel() * keys.element_size()
    fork = fork_cache(cache)
    _append(fork.layers[0], 3, 2)
    assert fork.layers[0].keys.shape[2] == 15 and fork.layers[0].keys.data_ptr() != pointer
    assert torch.equal(layer.keys, keys)


batch_ops = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.lists(st.integers(1, 40), min_size=1, max_size=3)),
        st.tuples(st.just("append"), st.integers(1, 90)),
        st.tuples(st.just("crop"), st.integers(1, 40)),
        st.tuples(st.just("keep"), st.lists(st.integers(0, 7), min_size=1, max_size=6, unique=True)),
        st.tuples(st.just("rebind"), st.just(0)),
    ),
    min_size=1,
    max_size=20,
)


def _row(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:  # a batch-1 cache's (keys, values)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g)


def _padded(t: torch.Tensor, size: int) -> torch.Tensor:  # [b, H, n, D] -> [b, H, size, D], zeros after
    return torch.nn.functional.pad(t, (0, 0, 0, size - t.shape[2]))


@settings(max_examples=80, deadline=None)
@given(batch_ops)
def test_a_batch_in_a_slab_holds_what_concatenated_rows_hold(steps):
    """A batch's rows in one slab (`SlabLayer.stack` for rows joining, `keep_batch` for rows leaving)
    hold exactly what `torch.cat` of the zero-padded rows and `index_select` hold (what a batch held
    before slabs), padding zeros included, under joins, appends, crops, rows leaving and rebinds
    (someone else's gather); a join into a slab with a spare row and room writes in place."""
    layer = SlabLayer(reserve=7)
    first = _row(7, 0)
    with torch.inference_mode():
        layer.update(*first)
        keys, values = first  # the reference: plain tensors [B, H, S, D]
        layer.stack(0, [(layer.keys, layer.values)], 7)
        for i, (op, arg) in enumerate(steps, start=1):
            B, S = keys.shape[0], keys.shape[2]
            if op == "join":
                rows = [_row(n, 100 * i + j) for j, n in enumerate(arg)]
                size = max(S, *arg)
                own = layer.keys.data_ptr() == layer.slabs[0].data_ptr()  # not rebound since
                room = own and layer.slabs[0].shape[0] >= B + len(rows) and layer.slabs[0].shape[2] >= size
                slab = layer.slabs[0].data_ptr()
                layer.stack(B, rows, size)
                assert not room or layer.slabs[0].data_ptr() == slab  # no copy of the live rows
                keys = torch.cat([_padded(keys, size), *(_padded(k, size) for k, _ in rows)])
                values = torch.cat([_padded(values, size), *(_padded(v, size) for _, v in rows)])
            elif op == "append":
                g = torch.Generator().manual_seed(i)
                k, v = torch.randn(B, H, arg, D, generator=g), torch.randn(B, H, arg, D, generator=g)
                layer.update(k, v)
                keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
            elif op == "crop" and arg < S:
                layer.crop(-arg)
                keys, values = keys[:, :, :-arg], values[:, :, :-arg]
            elif op == "keep":
                rows = [r for r in arg if r < B] or [0]
                if not layer.keep_batch(rows):
                    layer.keys, layer.values = layer.keys[rows], layer.values[rows]
                keys, values = keys[rows], values[rows]
            elif op == "rebind":  # a compaction's gather: new tensors, the next append copies them
                layer.keys, layer.values = layer.keys.flip(2), layer.values.flip(2)
                keys, values = keys.flip(2), values.flip(2)
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values), (i, op, arg)


def test_rows_leaving_a_batch_move_in_place_and_the_slab_keeps_its_spare_rows():
    layer = SlabLayer()
    with torch.inference_mode():
        layer.stack(0, [_row(5, 0), _row(3, 1), _row(4, 2)], 5)
        slab = layer.slabs[0]
        assert slab.shape[0] == 3
        kept = layer.keys[[2, 0]].clone()
        assert layer.keep_batch([2, 0]) and layer.slabs[0] is slab
        assert torch.equal(layer.keys, kept)
        layer.stack(2, [_row(6, 3)], 6)  # a spare row and spare slots: written in place
        assert layer.slabs[0] is slab and layer.keys.shape == (3, H, 6, D)
        layer.stack(3, [_row(2, 4), _row(2, 5)], 6)  # no spare row: a new slab, with half the live rows spare
        assert layer.slabs[0] is not slab and layer.slabs[0].shape[0] == 5 + 1
        assert torch.equal(layer.keys[:2, :, :6], _padded(kept, 6))


class _Toy(ModelSession):
    """A session whose logits after each token are a function of the whole sequence so far, so a
    wrong catch-up (a token kept that should have gone, or a missing refeed) shows in the logits."""

    V = 7

    def __init__(self, prompt: list[int]):
        self.seq, self.prompt_length, self.length = list(prompt), len(prompt), len(prompt)
        self.generated, self.fed = [], []
        self.prompt_logits = self.last_logits = _toy_logits(prompt)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [k] -> [k, V]
        out = []
        self.fed.append(tokens.tolist())
        for t in tokens.tolist():
            self.seq.append(t)
            self.generated.append(t)
            out.append(_toy_logits(self.seq))
        self.length = len(self.seq)
        self.last_logits = out[-1]
        return torch.stack(out)

    def rollback(self, length: int) -> None:
        if length < self.length:
            del self.seq[length:]
            del self.generated[length - self.prompt_length :]
            self.last_logits = self.prompt_logits if length == self.prompt_length else None
        self.length = length


def _toy_logits(seq: list[int]) -> torch.Tensor:  # -> [V]
    g = torch.Generator().manual_seed(hash(tuple(seq)) % (2**31))
    return torch.randn(_Toy.V, generator=g)


@given(
    prompt=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    ops=st.lists(
        st.tuples(st.sampled_from(["sync", "forward", "rollback"]), st.lists(st.integers(0, 2), max_size=5)),
        min_size=1,
        max_size=12,
    ),
)
@settings(max_examples=200, deadline=None)
def test_sync_catches_up_to_any_prefix_with_the_logits_after_it(prompt, ops):
    """After any forwards and rollbacks, `sync(prefix)` (`catch_up`: keep the common prefix, refeed
    the last token where its logits were dropped) leaves the session holding exactly `prefix`, with
    the logits a session fed `prefix` from scratch has; it feeds nothing it keeps."""
    s, emitted = _Toy(prompt), []
    for op, toks in ops:
        if op == "forward" and toks:
            s.forward(torch.tensor(toks))
        elif op == "rollback":
            s.rollback(s.prompt_length + min(len(toks), len(s.generated)))
        else:
            emitted = emitted[: len(toks)] + toks  # a round keeps some of the tokens and adds others
            prefix = torch.tensor(prompt + emitted)
            s.fed.clear()
            before = list(s.generated)
            kept = catch_up(before, emitted, s.last_logits is not None)
            logits = s.sync(prefix)
            assert s.seq == prompt + emitted
            torch.testing.assert_close(logits, _toy_logits(prompt + emitted), rtol=0, atol=0)
            assert sum(map(len, s.fed)) == len(emitted) - kept  # only what it did not keep
            assert kept >= common_prefix(before, emitted) - 1  # it refeeds one token at most
