"""The committed narration pair: it reads the video, its widened target, and a lossless hippo run on it.

Nothing is trained here; everything runs on the checkpoints in cli/pair/narrate/.
"""

from __future__ import annotations

import pytest
import torch

from hippo.benchmarks import bench
from hippo.benchmarks.batching import make_batch
from hippo.benchmarks.evaluate import HELD_OUT, greedy_ids
from hippo.cli.pair.checkpoint import NARRATE_DIR, load_pair
from hippo.cli.pair.narration import NARRATE_BENCH, narration_sample, step_token_score

SEEDS = range(HELD_OUT, HELD_OUT + 4)


@pytest.fixture(scope="module")
def pair():
    small, draft, tokenizer = load_pair(directory=NARRATE_DIR, wide=False)  # checks every file's SHA-256
    return small, draft, tokenizer


def _accuracy(model, tokenizer, samples) -> float:
    eos = tokenizer.eos_token_id
    ids = greedy_ids(model, make_batch(tokenizer, samples), max_new_tokens=400, eos=eos)
    scores = [
        step_token_score(tokenizer.decode([t for t in i if t != eos]), s.caption)
        for i, s in zip(ids, samples)
    ]
    return sum(r for r, _ in scores) / sum(t for _, t in scores)


def test_target_narrates_from_the_video(pair):
    target, _, tokenizer = pair
    ask = ("all", None)
    full = _accuracy(target, tokenizer, [narration_sample(s, NARRATE_BENCH, ask=ask) for s in SEEDS])
    blank = _accuracy(
        target, tokenizer, [narration_sample(s, NARRATE_BENCH, ask=ask, blank=True) for s in SEEDS]
    )
    assert full > blank + 0.1, (full, blank)


def test_widened_target_and_hippo_reproduce_the_trained_target(pair):
    """The widened benchmark target answers exactly as trained, and hippo (early pruning, draft on a
    thread here) reproduces HF generate on the real pair."""
    w = bench.narrate_workload(1, seed=0, frames=NARRATE_BENCH.frames, size=NARRATE_BENCH.size)
    small = pair[0]
    inputs = w.inputs[0]
    ref = small.generate(**inputs, max_new_tokens=40, do_sample=False)
    assert w.target.config.text_config.hidden_size > small.config.text_config.hidden_size
    assert torch.equal(w.target.generate(**inputs, max_new_tokens=40, do_sample=False), ref)
    rows = [m for m in bench.methods(0.1, 5, quick=True, compiled=False) if m.name == "HIPPO"]
    rows = [bench.Method(**{**rows[0].__dict__, "scheduler_options": {"gamma": 5}})]  # inline executor
    out = bench._pipeline(rows[0], w).generate(inputs, max_new_tokens=40, do_sample=False)
    assert torch.equal(out.sequences, ref)
    assert out.stats.mat > 1.5  # the trained draft agrees with the target
