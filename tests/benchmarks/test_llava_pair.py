"""The committed LLaVA-OneVision pair (benchmarks/pair_llava/): checksums, accuracy, lossless decoding.

Nothing is trained here; `python -m hippo.benchmarks.llava_pair --measure` gives the full figures.
"""

from __future__ import annotations

import pytest
import torch

from hippo.adapters.llava_onevision import LlavaOnevisionAdapter
from hippo.benchmarks.llava_pair import (
    HELD_OUT,
    MAX_NEW,
    SCHEMES,
    TASK,
    content_accuracy,
    load_pair,
    pipeline,
    processor_inputs,
    reference,
)
from hippo.cli.pair.task import sample

SEEDS = range(HELD_OUT, HELD_OUT + 8)


@pytest.fixture(scope="module")
def pair():
    return load_pair()  # checks every file's SHA-256 against checksums.json


def test_target_reads_the_video(pair):
    target, _, tokenizer = pair
    seen = content_accuracy(target, tokenizer, SEEDS)["content_accuracy"]
    blank = content_accuracy(target, tokenizer, SEEDS, blank=True)["content_accuracy"]
    assert seen >= blank + 0.2, (seen, blank)


@pytest.mark.parametrize("positions", SCHEMES)
def test_serial_pipeline_is_lossless(pair, positions):
    target, draft, tokenizer = pair
    pipe = pipeline(target, draft, positions, "holistic topk 0.1")
    assert pipe.draft_adapter.positions == positions
    for seed in SEEDS[:2]:
        inputs = processor_inputs(tokenizer, sample(seed, TASK).video)
        out = pipe.generate(inputs, max_new_tokens=MAX_NEW, do_sample=False)
        assert torch.equal(out.sequences, reference(target, inputs))


def test_the_schemes_differ_only_under_pruning(pair):
    _, draft, tokenizer = pair
    inputs = processor_inputs(tokenizer, sample(HELD_OUT, TASK).video)
    keep = torch.arange(0, 128, 10)  # 13 of the 128 frame tokens
    logits = {}
    for positions in SCHEMES:
        adapter = LlavaOnevisionAdapter(draft, positions=positions)
        encoded = adapter.encode(inputs)
        logits[positions] = (
            adapter.prefill(encoded, None).last_logits,
            adapter.prefill(encoded, keep).last_logits,
        )
    assert torch.equal(logits["original"][0], logits["compact"][0])
    assert not torch.allclose(logits["original"][1], logits["compact"][1])
