"""Training's batches prepared in worker processes (`train.phase_batches`) are the ones the training
process prepares itself, the distillation teacher's answers included, so `--workers` does not change
the checkpoints."""

from __future__ import annotations

import dataclasses

import torch

from hippo_benchmarks.pair import NARRATE_DIR
from hippo_benchmarks.tokenizer import build_tokenizer
from hippo_benchmarks.train import Phase, TrainConfig, phase_batches


def _fields(batch) -> dict:
    out = {k: v for k, v in dataclasses.asdict(batch).items() if k != "token_labels"}
    return {**out, **{f"label {k}": v for k, v in batch.token_labels.items()}}


def test_batches_from_workers_equal_the_in_process_ones():
    teacher = str(NARRATE_DIR / "target")
    phase = Phase("distil", 2, [(112, 32, 2), (112, 32, 1)], task="narrate", teacher=teacher)
    cfg = TrainConfig(role="draft", phases=[phase])
    tokenizer = build_tokenizer()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers take this process's thread count
    try:
        with phase_batches(cfg, 0, 0, tokenizer) as here:
            expected = [_fields(b) for b in here]
        with phase_batches(cfg, 0, 1, tokenizer) as ahead:
            got = [_fields(b) for b in ahead]
    finally:
        torch.set_num_threads(threads)
    assert [b["captions"].shape[0] for b in expected] == [2, 1]
    answers = [tokenizer.decode(row[:12]) for b in expected for row in b["captions"]]
    assert all(a.startswith("step one :") for a in answers), answers  # the teacher's narration
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for k in e:
            assert torch.equal(g[k], e[k]) if isinstance(e[k], torch.Tensor) else g[k] == e[k], k
