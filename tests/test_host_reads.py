"""Host reads per round: the CPU stand-in for GPU syncs (`hippo.syncs.HostReads`).

On a GPU each read of a tensor by the host stalls the device. A round reads once: a batch's greedy
drafting keeps its [B, γ] tokens on the device (`hippo.engine._draft`), p is fed them from there, and
they come back with the verdicts in one read (`hippo.accept.decide_reading`). Steady state is
measured as the extra reads of a longer answer over its extra rounds, outside the models' own
forwards, at batch 1 and batch 8.
"""

from __future__ import annotations

import pytest
import torch

from hippo.engine import Engine
from hippo.syncs import HostReads
from hippo.testing.models import Prompt, pixel_unit, text_ids
from hippo.testing.reference import build_pipeline

ADAPTER = "qwen2_5_vl"
#: reads per round of a batch at steady state: the verdicts with the draft tokens (the stacked
#: cache keeps the slots each row holds on the host, so rollback, cropping and compaction read none)
BATCH_READS = 1.0


@pytest.fixture(scope="module")
def setup(tiny):
    target = tiny(ADAPTER)
    draft = tiny(ADAPTER, "draft", seed=1)
    unit, words = pixel_unit(target), text_ids(target)
    prompts = [
        Prompt(
            ADAPTER, target, (1 + s % 2, 2 * unit, 2 * unit), s, words[10 + s : 13 + s], words[20:22]
        ).inputs
        for s in range(8)
    ]
    return build_pipeline(target, draft, scheduler="serial", gamma=4), prompts


def per_round(pipe, prompts, monkeypatch) -> tuple[float, dict]:
    """Extra host reads per extra engine round between 6 and 30 new tokens."""
    rounds = [0]
    step = Engine.step

    def counted(self):
        rounds[0] += 1
        return step(self)

    monkeypatch.setattr(Engine, "step", counted)

    def run(n: int) -> tuple[int, int, dict]:
        rounds[0] = 0
        with HostReads(where=True) as reads:
            pipe.generate_batch(prompts, max_new_tokens=n, do_sample=False) if len(
                prompts
            ) > 1 else pipe.generate(prompts[0], max_new_tokens=n, do_sample=False)
        return reads.count, rounds[0], reads.sites

    run(4)  # warm
    c0, r0, s0 = run(6)
    c1, r1, s1 = run(30)
    assert r1 > r0 + 3, (r0, r1)
    return (c1 - c0) / (r1 - r0), dict(s1 - s0)


def test_a_batch_reads_the_host_a_fixed_number_of_times_per_round(setup, monkeypatch):
    pipe, prompts = setup
    one, sites_one = per_round(pipe, prompts[:2], monkeypatch)
    eight, sites_eight = per_round(pipe, prompts, monkeypatch)
    assert eight <= BATCH_READS, sites_eight
    assert one <= BATCH_READS, sites_one
    assert eight <= one + 1.0, (one, eight, sites_eight)  # not growing with the batch


def test_a_job_alone_reads_the_host_as_a_batch_does(setup, monkeypatch):
    """`generate` runs the same round on the job's own sessions (`hippo.stacked.SessionRow`)."""
    pipe, prompts = setup
    alone, sites = per_round(pipe, prompts[:1], monkeypatch)
    assert alone <= BATCH_READS, sites  # the verdicts, with the draft's tokens


def test_the_counter_sees_each_kind_of_read():
    t = torch.arange(6)
    with HostReads() as reads:
        t.tolist()
        int(t[0])
        bool(t[1])
        torch.equal(t, t)
        t.nonzero()
        t[t > 2]
        t.argmax()  # stays on the device: not a read
    assert reads.kinds == {"tolist": 1, "item/bool/int": 2, "equal": 1, "nonzero": 1, "boolean index": 1}


def test_a_parallel_batch_reads_the_host_once_more_per_round(setup, monkeypatch):
    """`pearl` batched, its draft on a thread beside the target: the continuation's token table is one
    more read per round, in the draft thread (its reads counted too: it runs no mode of its own, but
    its `tolist` is the same wrapped method). A row's one token drafted before p verifies stays on
    the device: p and the draft thread are fed it from there, and each reads it with its own read."""
    import copy

    from hippo.testing.reference import build_pipeline

    pipe, prompts = setup
    thread = {"executor": "inline", "executor_options": {"overlap": "thread"}}
    pearl = build_pipeline(
        pipe.target, copy.deepcopy(pipe.target), scheduler="pearl", gamma=4, executor=thread
    )
    two, _ = per_round(pearl, prompts[:2], monkeypatch)
    eight, sites = per_round(pearl, prompts, monkeypatch)
    assert eight <= BATCH_READS + 1, sites
    assert eight <= two + 1.0, (two, eight, sites)
    pearl.close()
