"""Temporal (eqs. 3-4), spatial (eqs. 5-6) and holistic (eq. 7) scorers against naive float64 references,
plus their invariances: static video, scaled embeddings, constant frames, several videos."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scoring_refs import grids, holistic_ref, spatial_ref, temporal_ref, visual_from, with_embeds

from hippo.errors import ConfigError, InputError
from hippo.interfaces import ScoringContext
from hippo.plugins.scorers import HolisticScorer, SpatialScorer, TemporalScorer, frame_zscore
from hippo.testing import strategies as hs
from hippo.types import VisualTokens

dims = st.sampled_from([1, 3, 8])
seeds = st.integers(0, 2**16)


def temporal(visual, **options):
    return TemporalScorer.from_options(**options).score(visual, None)


def spatial(visual, **options):
    return SpatialScorer.from_options(**options).score(visual, None)


# ---- temporal -------------------------------------------------------------------------------


@settings(max_examples=hs.examples(6))
@given(grids, dims, seeds, st.integers(1, 60))
def test_temporal_matches_reference(g, d, seed, chunk):
    visual = visual_from(g, d, seed)
    torch.testing.assert_close(temporal(visual, chunk_tokens=chunk), temporal_ref(visual), rtol=0, atol=1e-12)


def test_temporal_static_video_is_zero_and_single_frame_is_zero():
    frame = torch.randn(1, 6 * 5, 16)
    static = VisualTokens(
        embeds=frame.expand(7, -1, -1).reshape(-1, 16), seq_index=torch.arange(210), grids=((7, 6, 5),)
    )
    assert temporal(static).abs().max() < 1e-6
    single = visual_from([(1, 4, 4)], 8, 0)
    assert torch.equal(temporal(single), torch.zeros(16, dtype=torch.float64))


def test_temporal_first_and_last_frames_have_one_neighbour():
    e = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]], dtype=torch.float64)  # 3 frames of 1 token
    visual = VisualTokens(embeds=e, seq_index=torch.arange(3), grids=((3, 1, 1),))
    torch.testing.assert_close(temporal(visual), torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64))


def test_temporal_never_crosses_videos():
    a = visual_from([(3, 2, 2), (2, 2, 2)], 8, 1)
    e = a.embeds.clone()
    e[12:] = torch.randn(8, 8, dtype=torch.float64)  # change only the second video
    b = with_embeds(a, e)
    assert torch.equal(temporal(a)[:12], temporal(b)[:12])
    # a video starting with a copy of the previous video's last frame is not "static" at its start
    e2 = a.embeds.clone()
    e2[12:16] = e2[8:12]
    assert torch.equal(temporal(with_embeds(a, e2))[:12], temporal(a)[:12])


# ---- spatial --------------------------------------------------------------------------------


@settings(max_examples=hs.examples(6))
@given(grids, dims, seeds, st.integers(1, 5), st.sampled_from(["tile", "window"]), st.integers(1, 60))
def test_spatial_matches_reference(g, d, seed, crop, mode, chunk):
    visual = visual_from(g, d, seed)
    got = spatial(visual, crop=crop, crop_mode=mode, chunk_tokens=chunk)
    torch.testing.assert_close(got, spatial_ref(visual, crop, mode), rtol=0, atol=1e-12)


def test_spatial_uniform_frame_is_zero_and_lone_tokens_are_zero():
    visual = VisualTokens(
        embeds=torch.ones(2 * 6 * 6, 4, dtype=torch.float64), seq_index=torch.arange(72), grids=((2, 6, 6),)
    )
    assert spatial(visual).abs().max() < 1e-12
    # a 6x6 frame tiled by 5x5 crops: the bottom-right crop holds a single token -> variance 0
    rnd = visual_from([(1, 6, 6)], 8, 3)
    assert float(spatial(rnd)[35]) == 0.0


# ---- invariances shared by the cosine-based scorers ------------------------------------------


@settings(max_examples=hs.examples(4))
@given(grids, seeds)
def test_cosine_scores_ignore_embedding_scale(g, seed):
    visual = visual_from(g, 8, seed)
    scale = (
        torch.rand(visual.n, 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 50
        + 0.01
    )
    scaled = with_embeds(visual, visual.embeds * scale)
    for fn in (temporal, lambda v: spatial(v, crop_mode="tile"), lambda v: spatial(v, crop_mode="window")):
        torch.testing.assert_close(fn(scaled), fn(visual), rtol=0, atol=1e-12)


def test_low_precision_embeddings_are_scored_in_float32():
    visual = visual_from([(3, 4, 4)], 16, 0, dtype=torch.bfloat16)
    ref = with_embeds(visual, visual.embeds.to(torch.float64))
    for fn in (temporal, spatial):
        got = fn(visual)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), fn(ref), rtol=0, atol=1e-5)


# ---- holistic -------------------------------------------------------------------------------


def vision_only(**options) -> HolisticScorer:
    return HolisticScorer.from_options(components=["temporal", "spatial"], **options)


@settings(max_examples=hs.examples(6))
@given(grids, seeds, st.lists(st.floats(-2, 2), min_size=3, max_size=3))
def test_fuse_matches_reference(g, seed, w):
    visual = visual_from(g, 6, seed)
    gen = torch.Generator().manual_seed(seed)
    comps = {
        "attention": torch.rand(visual.n, generator=gen, dtype=torch.float64) * 1e-4,
        "temporal": temporal_ref(visual),
        "spatial": spatial_ref(visual, 5, "tile"),
    }
    comps["spatial"][: g[0][1] * g[0][2]] = 0.25  # a constant frame
    scorer = HolisticScorer.from_options(weights=w)
    weights = dict(zip(scorer.config.components, w))
    got = scorer.fuse(visual, comps)
    torch.testing.assert_close(got, holistic_ref(visual, comps, weights, 1e-6), rtol=0, atol=1e-9)


def test_holistic_vision_only_matches_fused_components():
    visual = visual_from([(4, 5, 6), (2, 3, 3)], 8, 11)
    got = vision_only().score(visual, None)
    comps = {"temporal": temporal_ref(visual), "spatial": spatial_ref(visual, 5, "tile")}
    torch.testing.assert_close(
        got, holistic_ref(visual, comps, {"temporal": 1, "spatial": 1}, 1e-6), atol=1e-9, rtol=0
    )


def test_constant_frames_give_zero_not_nan():
    frame = torch.randn(1, 16, 8, dtype=torch.float64).expand(5, -1, -1).reshape(-1, 8)
    static = VisualTokens(embeds=frame, seq_index=torch.arange(80), grids=((5, 4, 4),))
    s = vision_only().score(static, None)
    assert not torch.isnan(s).any()
    # temporal is constant (0) everywhere, so only spatial z-scores remain
    spatial_only = HolisticScorer.from_options(components=["spatial"]).score(static, None)
    torch.testing.assert_close(s, spatial_only)
    flat = VisualTokens(embeds=torch.ones(80, 8), seq_index=torch.arange(80), grids=((5, 4, 4),))
    assert torch.equal(vision_only().score(flat, None), torch.zeros(80, dtype=torch.float64))
    z = frame_zscore(torch.tensor([3.0, 3.0, 1.0, 2.0]), torch.tensor([0, 0, 1, 1]), 2, 1e-6)
    torch.testing.assert_close(z, torch.tensor([0.0, 0.0, -1.0, 1.0], dtype=torch.float64))


def test_holistic_needs_target_prefill_for_attention():
    visual = visual_from([(2, 3, 3)], 4, 0)
    with pytest.raises(InputError, match="needs the target's prefill"):
        HolisticScorer().score(visual, ScoringContext(adapter=None, encoded=None, target=None))


@pytest.mark.parametrize(
    "bad",
    [
        {"components": []},
        {"components": ["attention", "attention"]},
        {"components": ["colour"]},
        {"weights": [1.0, 2.0]},
        {"weights": [1, 2, "x"]},
        {"crop": 0},
        {"crop_mode": "overlap"},
        {"eps": 0},
        {"layers": "all"},
    ],
)
def test_holistic_config_errors(bad):
    with pytest.raises(ConfigError):
        HolisticScorer.from_options(**bad)


def test_holistic_ablation_subsets_build():
    for comps in (["temporal", "spatial"], ["attention", "spatial"], ["attention", "temporal"], ["spatial"]):
        scorer = HolisticScorer.from_options(components=comps)
        assert list(scorer.parts) == comps
