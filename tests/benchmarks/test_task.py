"""The synthetic task: reproducible from a seed, captions that parse back, and the metrics."""

from __future__ import annotations

import torch

from hippo.cli.pair.task import (
    COLOURS,
    TaskConfig,
    caption_of,
    content_score,
    parse_caption,
    sample,
    token_score,
)


def test_sample_is_a_pure_function_of_the_seed():
    a, b, c = sample(7), sample(7), sample(8)
    assert torch.equal(a.video, b.video) and a.caption == b.caption
    assert not torch.equal(a.video, c.video)
    assert a.video.shape == (8, 112, 112, 3) and 0 <= float(a.video.min()) and float(a.video.max()) <= 1


def test_caption_names_each_object_in_colour_order():
    for seed in range(40):
        s = sample(seed)
        count, objs = parse_caption(s.caption)
        assert len(objs) == len(s.objects) == ("one", "two", "three").index(count) + 1
        assert [o[0] for o in objs] == sorted((o[0] for o in objs), key=COLOURS.index)
        assert caption_of(s.objects) == s.caption


def test_objects_cover_few_visual_tokens():
    cfg = TaskConfig(size=224, frames=16)
    s = sample(3, cfg)
    labels = s.token_labels["colour"]
    assert labels.numel() == cfg.visual_tokens == 8 * 8 * 8
    assert 0 < int((labels > 0).sum()) < 0.15 * labels.numel()


def test_content_and_token_scores():
    ref = "two objects . a red circle moves left . a blue square appears ."
    assert content_score(ref, ref)[:2] == (7, 7)
    right, total, fields = content_score("two objects . a red square moves left .", ref)
    assert (right, total) == (3, 7) and fields["shape"] == [0, 2] and fields["colour"] == [1, 2]
    assert token_score([1, 2, 3], [1, 5, 3, 4]) == (2, 4)


def test_blank_videos_keep_the_caption_but_show_nothing():
    s, blank = sample(11), sample(11, blank=True)
    assert s.caption == blank.caption
    assert float(blank.video.std()) == 0.0
