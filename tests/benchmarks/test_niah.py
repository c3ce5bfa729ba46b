"""The long-video task (needles in a haystack): deterministic clips, answers that depend on the needles,
labels and attention targets that line up with the answer, and clips sized to a visual-token count."""

from __future__ import annotations

import pytest
import torch

from hippo.benchmarks.tokenizer import build_tokenizer, caption_ids
from hippo.cli.pair.niah import (
    NEEDLE_PATCHES,
    NiahConfig,
    answer,
    config_for,
    needle_rows,
    needle_scores,
    niah_sample,
)
from hippo.cli.pair.task import TEMPORAL

SMALL = NiahConfig(size=112, frames=40)


def test_a_clip_is_a_pure_function_of_its_seed() -> None:
    a, b = niah_sample(7, SMALL), niah_sample(7, SMALL)
    assert torch.equal(a.video, b.video) and a.caption == b.caption
    assert a.caption != niah_sample(8, SMALL).caption


@pytest.mark.parametrize("seed", range(6))
def test_answers_are_long_and_list_the_needles_in_temporal_order(seed: int) -> None:
    smp = niah_sample(seed, SMALL)
    ids = caption_ids(build_tokenizer(), smp.caption)[:-1]
    assert 66 <= len(ids) <= 75 and build_tokenizer().unk_token_id not in ids
    assert len(smp.attend) == len(ids)  # one attention target per answer token
    starts = [n.start for n in smp.needles]
    assert starts == sorted(starts) and starts[0] == 0  # a needle at the very start (recency bias)
    assert starts[-1] == SMALL.frames - NEEDLE_PATCHES * TEMPORAL  # and one at the very end
    assert all(b - a >= NEEDLE_PATCHES * TEMPORAL for a, b in zip(starts, starts[1:]))  # never overlapping
    assert smp.caption == answer(smp.needles)


def test_labels_and_attention_targets_point_at_the_needles() -> None:
    smp = niah_sample(3, SMALL)
    rows = needle_rows(smp)
    order = smp.token_labels["step"]
    assert rows.numel() and set(order[rows].tolist()) <= set(range(1, len(smp.needles) + 1))
    for i, needle in enumerate(smp.needles):
        mine = (order == i + 1).nonzero().flatten()
        if mine.numel():  # a small needle can cover no token enough to be labelled
            assert set(smp.token_labels["colour"][mine].tolist()) == {needle.obj.colour + 1}
            t = mine // (SMALL.grid[1] * SMALL.grid[2])  # temporal patch of each token
            assert set(t.tolist()) <= set(
                range(needle.start // TEMPORAL, needle.start // TEMPORAL + NEEDLE_PATCHES)
            )
    looks = {a for a in smp.attend if a[0] > 0}
    assert looks == {(n.obj.colour + 1, i + 1, n.cell + 1) for i, n in enumerate(smp.needles)}
    assert smp.attend[0] == (-1, 0, 0)  # the count: every needle


def test_the_video_shows_the_needles_and_the_haystack_moves() -> None:
    smp = niah_sample(5, SMALL)
    first = smp.needles[0]
    frame = first.start + 1
    x, y = first.obj.centres[1].round().long().tolist()
    assert not torch.equal(smp.video[frame, y, x], smp.video[frame + NEEDLE_PATCHES * TEMPORAL, y, x])
    assert not torch.equal(smp.video[10, 20:40, 20:40], smp.video[11, 20:40, 20:40])  # the drift


def test_small_needles_occur() -> None:
    radii = [n.obj.radius for s in range(20) for n in niah_sample(s, SMALL).needles]
    assert min(radii) < 6 and max(radii) > 9


def test_config_for_a_visual_token_count() -> None:
    for n in (576, 2048, 8192):
        cfg = config_for(n)
        assert abs(cfg.visual_tokens - n) <= 36 and cfg.frames % 2 == 0
    with pytest.raises(ValueError, match="frames hold at most"):
        NiahConfig(frames=8)


def test_needle_scores() -> None:
    ref = niah_sample(2, SMALL).caption
    perfect = needle_scores(ref, ref)
    assert all(right == total for right, total in perfect.values())
    empty = needle_scores("", ref)
    assert empty["colour"] == [0, len(niah_sample(2, SMALL).needles)]


def test_the_long_video_draft_widens_function_preservingly_to_a_tenth_of_the_target() -> None:
    """The committed long-video pair's draft, widened as `hippo bench --long` loads it, computes the
    trained draft's logits (float64) and reads about 1/10 of the widened target's decoder weights
    and KV bytes per token."""
    from hippo.benchmarks.pair import DRAFT_WIDEN, NIAH_DIR, cost_ratios
    from hippo.benchmarks.tokenizer import processor_inputs
    from hippo.cli.pair.checkpoint import load_model, load_pair
    from hippo.cli.pair.niah import FPS, QUESTION
    from hippo.cli.pair.widen import max_logit_difference, norms_in_input_dtype, widen

    target, _, tokenizer = load_pair(directory=NIAH_DIR)  # also checks the checksums
    draft = load_model(NIAH_DIR / "draft", torch.float64)
    wide = widen(draft, **DRAFT_WIDEN[NIAH_DIR.name])
    inputs = processor_inputs(tokenizer, niah_sample(0, SMALL).video, QUESTION, fps=FPS, dtype=torch.float64)
    # ~1e-14 for k a power of two; with k = 3 the 1/k-scaled sums round differently ahead of the
    # attention's softmax, which transformers computes in float32: ~2.5e-7
    with norms_in_input_dtype():
        assert max_logit_difference(draft, wide, inputs) < 1e-6
    ratios = cost_ratios(target, wide)
    assert all(0.07 <= r <= 0.13 for r in ratios.values()), ratios


def test_a_draft_pruned_from_the_target_widens_to_a_tenth_of_it() -> None:
    """`niah_train --draft-from-target`'s draft (the target's layers 0, 2, 3), widened by its factors."""
    from hippo.benchmarks.niah_train import DRAFT_LAYERS, FROM_TARGET_WIDEN
    from hippo.benchmarks.pair import NIAH_DIR, cost_ratios
    from hippo.benchmarks.train import keep_layers
    from hippo.cli.pair.checkpoint import load_model, load_pair
    from hippo.cli.pair.widen import widen

    target = load_pair(directory=NIAH_DIR)[0]
    draft = load_model(NIAH_DIR / "target", torch.float32)
    keep_layers(draft, DRAFT_LAYERS)
    assert draft.config.text_config.num_hidden_layers == len(DRAFT_LAYERS)
    ratios = cost_ratios(target, widen(draft, **FROM_TARGET_WIDEN))
    assert all(0.07 <= r <= 0.13 for r in ratios.values()), ratios
