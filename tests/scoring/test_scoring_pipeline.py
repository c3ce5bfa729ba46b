"""Scoring inside a pipeline: registration, the paper's default (holistic + topk) stays lossless, the
position-bias analysis and its plot."""

from __future__ import annotations

import json

import pytest
import torch

import hippo
from hippo.adapters.qwen2_5_vl import Qwen25VLAdapter
from hippo.cli.bias import (
    boundary_mask,
    boundary_stats,
    plot_position_bias,
    position_bias,
    position_bias_from_scores,
)
from hippo.errors import ConfigError
from hippo.registry import registry
from hippo.types import VisualTokens
from hippo.visual import budget


@pytest.fixture(scope="module")
def models():
    return (
        Qwen25VLAdapter.tiny_model("target", seed=0, dtype=torch.float64),
        Qwen25VLAdapter.tiny_model("draft", seed=1, dtype=torch.float64),
    )


@pytest.fixture(scope="module")
def inputs(models):
    video = torch.rand(8, 140, 112, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return Qwen25VLAdapter.synthetic_inputs(models[0], video, [5, 6, 7], [8, 9, 10, 11])


def test_registered_names():
    assert {"attention", "temporal", "spatial", "holistic"} <= set(registry("scorers"))
    assert {"topk", "specvlm", "frame", "fastvid", "dycoke"} <= set(registry("selectors"))


@pytest.mark.parametrize(
    "scorer,options,selector",
    [
        ("holistic", {}, "topk"),
        ("holistic", {"components": ["temporal", "spatial"]}, "topk"),
        ("attention", {"layers": [-1]}, "specvlm"),
        (None, {}, "dycoke"),
    ],
)
def test_greedy_output_is_the_targets(models, inputs, scorer, options, selector):
    target, draft = models
    pipe = (
        hippo.PipelineBuilder()
        .target(target)
        .draft(draft)
        .scorer(scorer, **options)
        .selector(selector, keep_ratio=0.1)
        .scheduler("serial", gamma=3)
        .build()
    )
    out = pipe.generate(inputs, max_new_tokens=10, do_sample=False)
    with torch.inference_mode():
        ref = target.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert torch.equal(out.sequences, ref)
    n = out.stats.visual_tokens
    assert out.kept_visual_index.shape == (budget(n, 0.1),)


def test_bad_options_fail_at_build_time():
    with pytest.raises(ConfigError, match="holistic"):
        hippo.PipelineBuilder().scorer("holistic", weights=[1.0])
    with pytest.raises(ConfigError, match="topk"):
        hippo.PipelineBuilder().selector("topk", keep_ratio=2)


def test_boundary_rows():
    visual = VisualTokens(
        embeds=torch.zeros(2 * 20 * 3 + 4, 1), seq_index=torch.arange(124), grids=((2, 20, 3), (1, 2, 2))
    )
    edge = boundary_mask(visual, 0.1)
    rows = edge[:60].view(20, 3)[:, 0]
    assert rows.nonzero().flatten().tolist() == [0, 1, 18, 19]  # 10% of 20 rows at each edge
    assert edge[120:].all()  # a 2-row frame is all boundary
    kept = torch.tensor([0, 1, 2, 30, 63, 120])
    stats = boundary_stats(visual, kept, 0.1)
    assert stats["kept"] == 6 and stats["boundary_kept"] == 5
    assert [p["kept"] for p in stats["per_frame"]] == [4, 1, 1]
    assert stats["per_frame"][0]["boundary_share"] == 0.75
    assert stats["per_frame"][0]["base_rate"] == 0.2


def test_position_bias_end_to_end(models, inputs, tmp_path):
    target, draft = models
    pipe = hippo.PipelineBuilder().target(target).draft(draft).scorer("holistic").selector("topk").build()
    result = position_bias(pipe, inputs, keep_ratio=0.1)
    json.loads(json.dumps(result))  # JSON-serialisable
    assert set(result["methods"]) == {"attention", "holistic"}
    k = budget(result["tokens"], 0.1)
    for m in result["methods"].values():
        assert m["kept"] == k
        assert sum(p["kept"] for p in m["per_frame"]) == k
        assert 0 <= m["boundary_share"] <= 1
    png = plot_position_bias(result, tmp_path / "bias.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_position_bias_from_scores_detects_edge_crowding():
    visual = VisualTokens(embeds=torch.zeros(100, 1), seq_index=torch.arange(100), grids=((1, 10, 10),))
    edge = boundary_mask(visual).float()
    out = position_bias_from_scores(
        visual, {"edgy": edge + 0.01 * torch.arange(100), "centre": 1 - edge}, 0.2
    )
    assert out["base_rate"] == 0.2
    assert out["methods"]["edgy"]["boundary_share"] == 1.0 and out["methods"]["edgy"]["bias"] == 5.0
    assert out["methods"]["centre"]["boundary_share"] == 0.0
