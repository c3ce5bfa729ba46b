"""Grouped query heads packed onto their key/value heads (`hippo.gqa`): the same attention as
transformers' SDPA path, only inside hippo's forwards on a CPU, and every case it does not pack left
to the function it replaced."""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hippo
import hippo.gqa as gqa
from hippo.gqa import grouped_query_sdpa, packed_sdpa
from hippo.registry import lookup
from hippo.testing import models as hm
from hippo.testing import reference as hr


def _module(groups: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)


def _causal_mask(B: int, k: int, N: int, kind: str, gen: torch.Generator) -> torch.Tensor:  # -> [B, 1, k, N]
    """The last k of N positions attend causally, with some earlier positions masked per row (padding)."""
    allowed = torch.ones(B, 1, k, N, dtype=torch.bool)
    allowed[..., N - k :] = torch.ones(k, k, dtype=torch.bool).tril()
    allowed[..., : N - k] &= torch.rand(B, 1, 1, N - k, generator=gen) > 0.2
    if kind == "bool":
        return allowed
    return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(
        ~allowed, torch.finfo(torch.float64).min
    )


@settings(deadline=None)
@given(
    B=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    groups=st.sampled_from([2, 4]),
    k=st.integers(1, 7),
    past=st.integers(0, 40),
    D=st.sampled_from([4, 8]),
    mask=st.sampled_from(["none", "bool", "additive"]),
    seed=st.integers(0, 2**16),
)
def test_packed_attention_is_transformers_sdpa_attention(B, kv_heads, groups, k, past, D, mask, seed):
    gen = torch.Generator().manual_seed(seed)
    N = past + k
    q = torch.randn(B, kv_heads * groups, k, D, generator=gen, dtype=torch.float64)
    key = torch.randn(B, kv_heads, N, D, generator=gen, dtype=torch.float64)
    value = torch.randn(B, kv_heads, N, D, generator=gen, dtype=torch.float64)
    m = None if mask == "none" and k == 1 else _causal_mask(B, k, N, "bool" if mask == "none" else mask, gen)
    module = _module(groups)
    want, _ = sdpa_attention_forward(module, q, key, value, m, scaling=D**-0.5)
    with grouped_query_sdpa(torch.device("cpu")):
        assert gqa.packs(module, q, key, m, 0.0, {})
        got, _ = packed_sdpa(module, q, key, value, m, scaling=D**-0.5)
    assert got.shape == want.shape == (B, k, kv_heads * groups, D)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_packing_is_scoped_to_this_threads_cpu_forwards():
    """On only inside the context, on a CPU, on the calling thread; nested contexts restore it."""
    module, q1 = _module(2), torch.zeros(1, 4, 1, 8)
    key = torch.zeros(1, 2, 5, 8)
    assert not gqa.packs(module, q1, key, None, 0.0, {})
    seen = []
    with grouped_query_sdpa(torch.device("cpu")):
        assert gqa.packs(module, q1, key, None, 0.0, {})
        with grouped_query_sdpa(torch.device("cpu")):
            pass
        assert gqa.packs(module, q1, key, None, 0.0, {})
        other = threading.Thread(target=lambda: seen.append(gqa.packs(module, q1, key, None, 0.0, {})))
        other.start()
        other.join()
    assert seen == [False]
    assert not gqa.packs(module, q1, key, None, 0.0, {})
    with grouped_query_sdpa(torch.device("meta")):
        assert not gqa.packs(module, q1, key, None, 0.0, {})


@pytest.mark.parametrize(
    "case",
    [
        "one head per group",
        "dropout",
        "output_attentions",
        "position_bias",
        "causal prefill",
        "per-head mask",
    ],
)
def test_what_packing_would_change_goes_to_the_replaced_function(case, monkeypatch):
    calls = []
    monkeypatch.setattr(gqa, "_STOCK", lambda *a, **kw: calls.append((a, kw)) or ("stock", None))
    groups, k, kwargs, mask, dropout = 2, 3, {}, torch.ones(1, 1, 3, 6, dtype=torch.bool), 0.0
    if case == "one head per group":
        groups = 1
    elif case == "dropout":
        dropout = 0.1
    elif case in ("output_attentions", "position_bias"):
        kwargs[case] = torch.zeros(1) if case == "position_bias" else True
    elif case == "causal prefill":
        k, mask = 6, None
    else:
        mask = torch.ones(1, 2 * groups, 3, 6, dtype=torch.bool)
    q = torch.zeros(1, 2 * groups, k, 8)
    key = torch.zeros(1, 2, 6, 8)
    with grouped_query_sdpa(torch.device("cpu")):
        out = packed_sdpa(_module(groups), q, key, key, mask, dropout=dropout, **kwargs)
    assert out == ("stock", None)
    assert calls and calls[0][0][4] is mask and calls[0][1]["dropout"] == dropout


def test_a_sessions_steps_and_verifications_are_packed_and_unchanged(monkeypatch):
    """A tiny grouped-query target (2 query heads per K/V head), float64: a session's step and 4-token
    verification pack every decoder layer's attention, and their logits are those of transformers'
    own SDPA path."""
    target = hm.tiny("qwen2_5_vl", "target")
    text = target.config.text_config
    assert text.num_attention_heads > text.num_key_value_heads
    unit = hm.pixel_unit(target)
    inputs = hm.Prompt("qwen2_5_vl", target, (2, 2 * unit, 2 * unit), 0, [], []).inputs
    adapter = lookup("adapters", "qwen2_5_vl")(target)
    session = adapter.prefill(adapter.encode(inputs), None)
    L, real_packs = session.length, gqa.packs
    for k in (1, 4):
        tokens = torch.arange(3, 3 + k)
        packed: list[bool] = []
        monkeypatch.setattr(gqa, "packs", lambda *a, seen=packed: seen.append(real_packs(*a)) or seen[-1])
        got = session.forward(tokens)
        session.rollback(L)
        assert packed == [True] * text.num_hidden_layers
        monkeypatch.setattr(gqa, "packs", lambda *a: False)
        want = session.forward(tokens)
        session.rollback(L)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """torch's thread count for a block (the tests run one thread each), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@settings(deadline=None, max_examples=60)
@given(
    B=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    groups=st.sampled_from([2, 4]),
    k=st.integers(1, 7),
    past=st.integers(0, 60),
    mask=st.sampled_from(["none", "bool", "additive"]),
    n_threads=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
def test_a_long_cache_split_across_threads_is_the_same_attention(
    B, kv_heads, groups, k, past, mask, n_threads, seed
):
    """Where a cache is read by fewer (row, KV head) pairs than threads, it is cut into
    one stretch per thread (`split_kv_sdpa`), including cache lengths that do not divide (overlapping
    stretches) and masks that hide a whole stretch from a row (padding): float64, transformers' own
    SDPA attention to 1e-12."""
    gen = torch.Generator().manual_seed(seed)
    N = past + k
    q = torch.randn(B, kv_heads * groups, k, 8, generator=gen, dtype=torch.float64)
    key = torch.randn(B, kv_heads, N, 8, generator=gen, dtype=torch.float64)
    value = torch.randn(B, kv_heads, N, 8, generator=gen, dtype=torch.float64)
    m = None if mask == "none" and k == 1 else _causal_mask(B, k, N, "bool" if mask == "none" else mask, gen)
    if m is not None and past >= 8:  # the first stretch hidden whole from row 0 (left padding)
        m[0, ..., : past // 2] = False if m.dtype == torch.bool else torch.finfo(torch.float64).min
    module = _module(groups)
    want, _ = sdpa_attention_forward(module, q, key, value, m, scaling=8**-0.5)
    split: list[bool] = []
    real = gqa.splits
    spy = mock.patch.object(gqa, "splits", lambda *a: split.append(real(*a)) or split[-1])
    with (
        _threads(n_threads),
        mock.patch.object(gqa, "SPLIT_KV_MIN", 1),
        spy,
        grouped_query_sdpa(torch.device("cpu")),
    ):
        got, _ = packed_sdpa(module, q, key, value, m, scaling=8**-0.5)
    assert split == [B * kv_heads < n_threads and N >= 2]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_sessions_long_cache_is_split_and_its_logits_unchanged(monkeypatch):
    """The tiny grouped-query target's session (2 K/V heads) with the split on for any cache
    (`SPLIT_KV_MIN` = 1) and 3 threads: its step and 4-token verification split every layer's
    attention in three stretches, and their logits are those of transformers' own SDPA path
    (float64)."""
    target = hm.tiny("qwen2_5_vl", "target")
    unit = hm.pixel_unit(target)
    inputs = hm.Prompt("qwen2_5_vl", target, (2, 2 * unit, 2 * unit), 0, [], []).inputs
    adapter = lookup("adapters", "qwen2_5_vl")(target)
    session = adapter.prefill(adapter.encode(inputs), None)
    L, real = session.length, gqa.splits
    monkeypatch.setattr(gqa, "SPLIT_KV_MIN", 1)
    for k in (1, 4):
        tokens = torch.arange(3, 3 + k)
        split: list[bool] = []
        with (
            _threads(3),
            mock.patch.object(gqa, "splits", lambda *a, seen=split: seen.append(real(*a)) or seen[-1]),
        ):
            got = session.forward(tokens)
        session.rollback(L)
        assert split == [True] * target.config.text_config.num_hidden_layers
        with mock.patch.object(gqa, "packs", lambda *a: False):
            want = session.forward(tokens)
        session.rollback(L)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_a_batch_decoded_with_every_cache_split_is_exact(monkeypatch):
    """Speculative decoding of two rows of different lengths (a stacked cache with padding and
    rolled-back slots) with every attention split (`SPLIT_KV_MIN` = 1, 5 threads for 2 rows x 2 K/V
    heads): every row equals the target's own greedy output (float64)."""
    target, draft = hm.tiny("qwen2_5_vl", "target"), hm.tiny("qwen2_5_vl", "draft")
    prompts = [hm.Prompt.default("qwen2_5_vl", target), hm.Prompt.default("qwen2_5_vl", target, frames=1)]
    pipe = hippo.PipelineBuilder().target(target).draft(draft).scheduler("serial", gamma=3).build()
    gen = {"do_sample": False, "max_new_tokens": 12}
    split: list[bool] = []
    real = gqa.splits
    monkeypatch.setattr(gqa, "SPLIT_KV_MIN", 1)
    monkeypatch.setattr(gqa, "splits", lambda *a: split.append(real(*a)) or split[-1])
    with _threads(5):
        outs = pipe.generate_batch([p.inputs for p in prompts], **gen)
    pipe.close()
    assert any(split)
    for out, p in zip(outs, prompts):
        hr.assert_same(out, hr.reference(target, p.inputs, **gen), p.length)
