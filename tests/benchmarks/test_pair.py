"""The committed pair: checksums, held-out accuracy, and the function-preserving widening.

Nothing is trained here; everything runs on the committed checkpoints in benchmarks/pair/.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from hippo.benchmarks.batching import make_batch
from hippo.benchmarks.evaluate import HELD_OUT, evaluate, greedy_ids
from hippo.benchmarks.pair import PAIR_DIR
from hippo.benchmarks.tokenizer import processor_inputs
from hippo.cli.pair.checkpoint import NARRATE_DIR, ChecksumError, load_pair
from hippo.cli.pair.task import TaskConfig, sample
from hippo.cli.pair.widen import max_logit_difference, norms_in_input_dtype, widen

SEEDS = range(HELD_OUT, HELD_OUT + 16)


@pytest.fixture(scope="module")
def small():
    target, draft, tokenizer = load_pair(wide=False, directory=PAIR_DIR)  # checks every file's SHA-256
    return target, draft, tokenizer


@pytest.fixture(scope="module")
def wide():
    return load_pair(directory=PAIR_DIR)[0]  # also checks the widened weights' SHA-256


@pytest.mark.parametrize("pair", ["qwen2_5_vl", "narrate", "llava_onevision"])
def test_a_changed_file_fails_the_checksum(tmp_path, pair):
    from hippo.benchmarks import llava_pair

    source, load = {
        "qwen2_5_vl": (PAIR_DIR, lambda d: load_pair(directory=d)),
        "narrate": (NARRATE_DIR, lambda d: load_pair(directory=d)),
        "llava_onevision": (llava_pair.PAIR_DIR, lambda d: llava_pair.load_pair(d)),
    }[pair]
    copy = tmp_path / "pair"
    shutil.copytree(source, copy)
    config = copy / "draft" / "config.json"
    config.write_text(config.read_text().replace('"hidden_act"', ' "hidden_act"', 1))
    with pytest.raises(ChecksumError, match="draft/config.json"):
        load(copy)


def test_target_is_accurate_on_held_out_videos(small):
    target, _, tokenizer = small
    scores = evaluate(target, tokenizer, TaskConfig(), n=len(SEEDS), first_seed=SEEDS[0])
    assert scores.content_accuracy >= 0.8, scores.summary()


def test_blank_videos_drop_accuracy_to_chance(small):
    target, _, tokenizer = small
    scores = evaluate(target, tokenizer, TaskConfig(), n=len(SEEDS), first_seed=SEEDS[0], blank=True)
    assert scores.content_accuracy < 0.45, scores.summary()


def test_widening_preserves_the_logits_in_float64(small):
    target = small[0].double()
    try:
        wide = widen(target)
        inputs = processor_inputs(small[2], sample(SEEDS[0]).video, dtype=torch.float64)
        with norms_in_input_dtype():
            assert max_logit_difference(target, wide, inputs) < 1e-10
    finally:
        small[0].float()


def test_widened_target_gives_the_same_greedy_captions(small, wide):
    target, _, tokenizer = small
    assert wide.config.text_config.hidden_size == 4 * target.config.text_config.hidden_size
    batch = make_batch(tokenizer, [sample(s) for s in SEEDS[:8]])
    assert greedy_ids(wide, batch) == greedy_ids(target, batch)


def test_widened_target_matches_generate(small, wide):
    tokenizer = small[2]
    inputs = processor_inputs(tokenizer, sample(SEEDS[1]).video)
    a = small[0].generate(**inputs, max_new_tokens=24, do_sample=False)
    b = wide.generate(**inputs, max_new_tokens=24, do_sample=False)
    assert torch.equal(a, b)
