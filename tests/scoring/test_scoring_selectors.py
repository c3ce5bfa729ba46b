"""Ranked selectors (topk, specvlm) and the single-model baselines (frame, fastvid, dycoke): every one
returns exactly budget(N, keep_ratio) ascending unique in-range indices, plus each one's own rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scoring_refs import grids, visual_from

from hippo.errors import ConfigError, InputError
from hippo.plugins.baselines import DyCokeSelector, FastVIDSelector, FrameSelector
from hippo.plugins.ranked_selectors import SpecVLMSelector, TopKSelector
from hippo.registry import lookup
from hippo.testing import strategies as hs
from hippo.types import VisualTokens
from hippo.visual import budget

SELECTORS = [
    ("topk", {}),
    ("topk", {"per_frame": True}),
    ("specvlm", {}),
    ("specvlm", {"mass": 0.0}),
    ("specvlm", {"mass": 1.0}),
    ("frame", {}),
    ("fastvid", {"block": 7, "segments": 3}),
    ("dycoke", {}),
    ("sink_window", {}),
    ("sink_window", {"sink": 0.0}),
    ("sink_window", {"sink": 1.0}),
    ("oracle", {}),
    ("oracle", {"keep": (0, 3, 5)}),
]
ratios = st.floats(0.001, 1.0)


@settings(max_examples=hs.examples(4))
@pytest.mark.parametrize("name,options", SELECTORS, ids=[f"{n}{o}" for n, o in SELECTORS])
@given(g=grids, ratio=ratios, seed=st.integers(0, 2**16), ties=st.booleans(), negative=st.booleans())
def test_exact_budget_sorted_unique_in_range(name, options, g, ratio, seed, ties, negative):
    visual = visual_from(g, 6, seed)
    gen = torch.Generator().manual_seed(seed)
    scores = (
        torch.randint(0, 3, (visual.n,), generator=gen).double()
        if ties
        else torch.rand(visual.n, generator=gen)
    )
    if negative:
        scores = scores - 1.5
    selector = lookup("selectors", name).from_options(keep_ratio=ratio, **options)
    kept = selector.select(visual, scores, torch.Generator().manual_seed(0))
    assert kept.dtype == torch.long
    assert kept.shape == (budget(visual.n, ratio),)
    assert torch.equal(kept, torch.unique(kept))  # sorted ascending, unique
    assert int(kept.min()) >= 0 and int(kept.max()) < visual.n
    again = selector.select(visual, scores, torch.Generator().manual_seed(1))
    assert torch.equal(kept, again)  # deterministic


def test_topk_keeps_highest_and_per_frame_shares():
    visual = visual_from([(2, 2, 5)], 4, 0)  # 2 frames of 10
    scores = torch.cat([torch.arange(10.0) + 100, torch.arange(10.0)])
    assert TopKSelector.from_options(keep_ratio=0.2).select(visual, scores, None).tolist() == [6, 7, 8, 9]
    per = TopKSelector.from_options(keep_ratio=0.2, per_frame=True).select(visual, scores, None)
    assert per.tolist() == [8, 9, 18, 19]
    ties = torch.zeros(20)
    assert TopKSelector.from_options(keep_ratio=0.1).select(visual, ties, None).tolist() == [0, 1]


def test_topk_budget_spans_all_videos():
    visual = visual_from([(1, 2, 2), (1, 2, 2)], 4, 0)
    scores = torch.tensor([0.0, 0, 0, 0, 1, 2, 3, 4])
    assert TopKSelector.from_options(keep_ratio=0.5).select(visual, scores, None).tolist() == [4, 5, 6, 7]


def test_specvlm_two_stages():
    visual = visual_from([(1, 1, 20)], 4, 0)
    scores = torch.full((20,), 0.01)
    scores[[3, 15]] = torch.tensor([0.5, 0.3])  # together 0.8 of 0.98: stage I stops after 3 (0.51 >= 0.4)
    kept = SpecVLMSelector.from_options(keep_ratio=0.25, mass=0.4).select(visual, scores, None)
    # stage I: [3]; stage II: 4 evenly spaced over the 19 others (linspace 0..18 -> 0, 6, 12, 18)
    rest = [i for i in range(20) if i != 3]
    assert kept.tolist() == sorted([3] + [rest[j] for j in (0, 6, 12, 18)])
    # mass 0.7 needs both peaks
    kept = SpecVLMSelector.from_options(keep_ratio=0.25, mass=0.7).select(visual, scores, None)
    assert {3, 15} <= set(kept.tolist())
    # stage I is capped by the budget
    kept = SpecVLMSelector.from_options(keep_ratio=0.05, mass=1.0).select(visual, scores, None)
    assert kept.tolist() == [3]


def test_frame_keeps_whole_evenly_spaced_frames():
    visual = visual_from([(10, 2, 2)], 4, 0)  # 10 frames of 4 tokens, budget 8 -> 2 frames
    kept = FrameSelector.from_options(keep_ratio=0.2).select(visual, None, None)
    assert kept.tolist() == [0, 1, 2, 3, 36, 37, 38, 39]  # frames 0 and 9
    kept = FrameSelector.from_options(keep_ratio=0.3).select(visual, None, None)  # 12 -> frames 0, 4/5, 9
    frames = sorted(set((kept // 4).tolist()))
    assert len(frames) == 3 and frames[0] == 0 and frames[-1] == 9 and len(kept) == 12
    # a budget that does not fill whole frames: one frame is trimmed
    kept = FrameSelector.from_options(keep_ratio=0.25).select(visual, None, None)  # 10 tokens, 3 frames
    counts = torch.bincount(kept // 4, minlength=10)
    assert sorted(counts[counts > 0].tolist()) == [2, 4, 4]


def test_dycoke_drops_repeats_of_the_last_kept_token():
    base = torch.randn(1, 4, 8, dtype=torch.float64)
    frames = base.repeat(4, 1, 1)
    frames[2, 1] = torch.randn(8, dtype=torch.float64)  # position 1 changes in frame 2
    frames[3, 1] = frames[2, 1]  # ... and stays changed: redundant w.r.t. frame 2, not frame 0
    visual = VisualTokens(embeds=frames.reshape(-1, 8), seq_index=torch.arange(16), grids=((4, 2, 2),))
    survive, novelty = DyCokeSelector().merge(visual)
    assert survive.nonzero().flatten().tolist() == [0, 1, 2, 3, 9]
    kept = DyCokeSelector.from_options(keep_ratio=5 / 16).select(visual, None, None)
    assert kept.tolist() == [0, 1, 2, 3, 9]
    kept = DyCokeSelector.from_options(keep_ratio=2 / 16).select(visual, None, None)
    assert len(kept) == 2 and set(kept.tolist()) <= {0, 1, 2, 3, 9}


def test_fastvid_cuts_at_scene_changes_and_video_boundaries():
    g = torch.Generator().manual_seed(0)
    scene_a, scene_b = torch.randn(1, 9, 16, generator=g), torch.randn(1, 9, 16, generator=g)
    frames = torch.cat([scene_a.repeat(3, 1, 1), scene_b.repeat(3, 1, 1)]) + 0.01 * torch.randn(
        6, 9, 16, generator=g
    )
    other = torch.randn(1, 9, 16, generator=g).repeat(2, 1, 1).reshape(-1, 16)  # one static scene
    visual = VisualTokens(
        embeds=torch.cat([frames.reshape(-1, 16), other]),
        seq_index=torch.arange(72),
        grids=((6, 3, 3), (2, 3, 3)),
    )
    segs = FastVIDSelector.from_options(segments=1, threshold=0.5).segments(visual)
    assert segs == [(0, 27), (27, 54), (54, 72)]
    kept = FastVIDSelector.from_options(segments=1, threshold=0.5, keep_ratio=0.25).select(visual, None, None)
    per_segment = [int(((kept >= a) & (kept < b)).sum()) for a, b in segs]
    assert per_segment == [7, 7, 4]  # 18 kept, apportioned 27:27:18


def test_score_errors():
    visual = visual_from([(1, 2, 2)], 4, 0)
    with pytest.raises(ConfigError, match="add a scorer"):
        TopKSelector().select(visual, None, None)
    with pytest.raises(InputError, match="one score per visual token"):
        TopKSelector().select(visual, torch.zeros(3), None)
    with pytest.raises(InputError, match="NaN"):
        SpecVLMSelector().select(visual, torch.tensor([0.0, float("nan"), 1, 2]), None)
    for cls, bad in (
        (TopKSelector, {"keep_ratio": 0}),
        (TopKSelector, {"per_frame": 1}),
        (SpecVLMSelector, {"mass": 1.5}),
        (FastVIDSelector, {"segments": 0}),
        (FastVIDSelector, {"threshold": 2}),
        (DyCokeSelector, {"threshold": "high"}),
    ):
        with pytest.raises(ConfigError):
            cls.from_options(**bad)
    assert TopKSelector.needs_scores and SpecVLMSelector.needs_scores
    assert not (FrameSelector.needs_scores or FastVIDSelector.needs_scores or DyCokeSelector.needs_scores)


def test_sink_window_keeps_the_start_and_the_end():
    visual = VisualTokens(torch.zeros(100, 4), torch.arange(100), ((4, 5, 5),))
    kept = lookup("selectors", "sink_window").from_options(keep_ratio=0.1, sink=0.3)
    assert kept.select(visual, None, torch.Generator()).tolist() == [0, 1, 2, 93, 94, 95, 96, 97, 98, 99]


def test_oracle_keeps_its_indices_and_fills_the_budget_uniformly():
    visual = VisualTokens(torch.zeros(100, 4), torch.arange(100), ((4, 5, 5),))
    oracle = lookup("selectors", "oracle")
    kept = oracle.from_options(keep=[3, 50, 99, 200], keep_ratio=0.1).select(visual, None, torch.Generator())
    assert {3, 50, 99} <= set(kept.tolist()) and kept.numel() == 10  # 200 is past the video
    assert oracle.from_options(keep=torch.tensor([1, 2, 4]), keep_ratio=0.01).select(
        visual, None, torch.Generator()
    ).tolist() == [2]  # more needles than the budget: a uniform lattice of them
    with pytest.raises(ConfigError, match="keep must hold visual-token indices >= 0"):
        oracle.from_options(keep=[-1])
