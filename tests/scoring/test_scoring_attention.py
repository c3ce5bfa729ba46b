"""The attention scorer (eq. 2): chunked kernel vs a materialised softmax, scorer vs HF's own eager
attention weights on a tiny float64 Qwen2.5-VL, and hooks that leave the target bit-identical."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scoring_refs import attention_ref, multi_video_inputs

from hippo.adapters.qwen2_5_vl import Qwen25VLAdapter
from hippo.errors import ConfigError, InputError, UnsupportedError
from hippo.interfaces import ScoringContext
from hippo.plugins.attention import AttentionScorer, query_rows, text_to_visual_attention
from hippo.testing import strategies as hs

# ---- the chunked kernel ---------------------------------------------------------------------


@st.composite
def kernel_case(draw):
    hkv = draw(st.integers(1, 3), label="kv heads")
    groups = draw(st.sampled_from([1, 2, 4]), label="GQA groups")
    d = draw(st.sampled_from([2, 4, 8]), label="head dim")
    L = draw(st.integers(1, 40), label="keys")
    rows = sorted(draw(st.sets(st.integers(0, L - 1), min_size=1, max_size=6), label="query rows"))
    cols = sorted(draw(st.sets(st.integers(0, L - 1), min_size=1, max_size=L), label="visual cols"))
    chunk = draw(st.integers(1, 50), label="chunk")
    window = draw(st.none() | st.integers(1, 12), label="sliding window")
    normaliser = draw(st.sampled_from(["causal", "visual"]), label="normaliser")
    seed = draw(st.integers(0, 2**16), label="seed")
    return hkv, groups, d, L, rows, cols, chunk, window, normaliser, seed


@settings(max_examples=hs.examples(8))
@given(kernel_case())
def test_kernel_matches_materialised_softmax(case):
    hkv, groups, d, L, rows, cols, chunk, window, normaliser, seed = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hkv * groups, len(rows), d, generator=g, dtype=torch.float64) * 2
    k = torch.randn(hkv, L, d, generator=g, dtype=torch.float64) * 2
    rows, cols = torch.tensor(rows), torch.tensor(cols)
    got = text_to_visual_attention(q, k, rows, cols, chunk=chunk, window=window, normaliser=normaliser)
    want = attention_ref(q, k, rows, cols, window, normaliser)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_kernel_large_logits_do_not_overflow():
    q = torch.full((2, 3, 4), 300.0)  # logits around 3e5: a naive exp would overflow
    k = torch.randn(1, 20, 4, generator=torch.Generator().manual_seed(0)).abs()
    rows, cols = torch.tensor([17, 18, 19]), torch.arange(0, 15)
    got = text_to_visual_attention(q, k, rows, cols, chunk=3)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, attention_ref(q, k, rows, cols).float(), rtol=1e-4, atol=1e-6)


# ---- the scorer on a real (tiny) model ------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return Qwen25VLAdapter.tiny_model("target", seed=3, dtype=torch.float64)


@pytest.fixture(scope="module")
def adapter(model):
    return Qwen25VLAdapter(model)


def video(t, h, w, seed):
    return torch.rand(t, h, w, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def score_with(adapter, encoded, **options):
    scorer = AttentionScorer.from_options(**options)
    with scorer.observe_target_prefill(adapter, encoded):
        session = adapter.prefill(encoded, keep=None)
    return scorer.score(encoded.visual, ScoringContext(adapter, encoded, session)), session, scorer


@contextlib.contextmanager
def eager(model):
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def hf_reference(model, encoded, rows, layers=None):  # -> [N] from HF's returned attention weights
    with eager(model), torch.no_grad():
        out = model(
            inputs_embeds=encoded.embeds[None],
            position_ids=encoded.positions[:, None, :],
            output_attentions=True,
        )
    att = out.attentions if layers is None else [out.attentions[i] for i in layers]
    cols = encoded.visual.seq_index
    return torch.stack([a[0][:, rows][:, :, cols].mean(dim=(0, 1)) for a in att]).mean(0)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"chunk_size": 5},
        {"queries": "text", "chunk_size": 7},
        {"layers": [0, -1], "chunk_size": 3},
    ],
    ids=["default", "chunked", "text-queries", "layer-subset"],
)
def test_scorer_matches_hf_attention_weights(model, adapter, options):
    inputs = Qwen25VLAdapter.synthetic_inputs(model, video(6, 84, 112, 1), [5, 6, 7], [8, 9, 10, 11])
    encoded = adapter.encode(inputs)
    got, session, scorer = score_with(adapter, encoded, **options)
    rows = query_rows(encoded, scorer.config.queries)
    n_layers = len(adapter.attention_modules())
    layers = None if "layers" not in options else [i % n_layers for i in options["layers"]]
    want = hf_reference(model, encoded, rows, layers)
    # HF's eager softmax runs in float32 even for float64 models, hence the tolerance
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    assert got.shape == (encoded.visual.n,)


def test_scorer_matches_materialised_reference_exactly(model, adapter):
    """Same captured queries and cached keys, full softmax materialised: agreement to float64 rounding."""
    inputs = Qwen25VLAdapter.synthetic_inputs(model, video(4, 56, 56, 2), [5], [8, 9])
    encoded = adapter.encode(inputs)
    got, session, scorer = score_with(adapter, encoded, chunk_size=4)
    cap = scorer._capture
    want = 0
    for layer in cap.layers:
        q = adapter.project_queries(layer, cap.hidden[layer], cap.cos_sin[layer])
        keys = adapter.cached_keys(session, layer)
        want = want + attention_ref(q, keys, cap.rows, encoded.visual.seq_index) / (
            q.shape[0] * len(cap.rows)
        )
    torch.testing.assert_close(got, want / len(cap.layers), rtol=1e-12, atol=1e-14)


def test_two_videos_text_between(model, adapter):
    inputs = multi_video_inputs(
        model, [video(4, 56, 84, 3), video(2, 84, 56, 4)], [[5, 6], [7, 8], [9, 10, 11]]
    )
    encoded = adapter.encode(inputs)
    assert len(encoded.visual.grids) == 2
    for queries in ("after_video", "text"):
        got, _, scorer = score_with(adapter, encoded, queries=queries, chunk_size=6)
        want = hf_reference(model, encoded, query_rows(encoded, queries))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    # "text" queries include the tokens between the videos, which see only the first video
    rows = query_rows(encoded, "text")
    first_video_end = int(encoded.visual.seq_index[encoded.visual.grids[0][0] * 6 - 1])
    assert int(rows.min()) == first_video_end + 1


def test_hooks_leave_target_bit_identical(model, adapter):
    inputs = Qwen25VLAdapter.synthetic_inputs(model, video(4, 56, 84, 5), [5, 6], [8, 9, 10])
    encoded = adapter.encode(inputs)
    plain = adapter.prefill(encoded, keep=None)
    _, observed, _ = score_with(adapter, encoded)
    assert torch.equal(plain.last_logits, observed.last_logits)
    for a, b in zip(plain.cache.layers, observed.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # and the hooks are gone afterwards
    assert all(not m._forward_pre_hooks for m in adapter.attention_modules())
    # decoding on from the observed prefill matches too
    nxt = torch.tensor([int(plain.last_logits.argmax())])
    assert torch.equal(plain.forward(nxt), observed.forward(nxt))


def test_errors(model, adapter):
    inputs = Qwen25VLAdapter.synthetic_inputs(model, video(2, 56, 56, 6), [5], [8])
    encoded = adapter.encode(inputs)
    scorer = AttentionScorer()
    with pytest.raises(InputError, match="needs the target's prefill"):
        scorer.score(encoded.visual, ScoringContext(adapter, encoded, None))
    session = adapter.prefill(encoded, keep=None)  # not observed
    with pytest.raises(InputError, match="did not observe"):
        scorer.score(encoded.visual, ScoringContext(adapter, encoded, session))
    with pytest.raises(ConfigError, match="layer 7 does not exist"):
        with AttentionScorer.from_options(layers=[7]).observe_target_prefill(adapter, encoded):
            pass
    for bad in ({"layers": []}, {"queries": "all"}, {"chunk_size": 0}, {"softmax_over": "x"}, {"nope": 1}):
        with pytest.raises(ConfigError):
            AttentionScorer.from_options(**bad)

    class Bare:  # an adapter without the attention read-out methods
        pass

    with pytest.raises(UnsupportedError, match="lacks attention_modules"):
        with AttentionScorer().observe_target_prefill(Bare(), encoded):
            pass
