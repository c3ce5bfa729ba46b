"""A parallel batch's draft rows in the draft process (`executor="process"`): q's stacked cache and
its rows' bookkeeping live there (`hippo.engine.DraftRows` behind `ProcessBatchDraft`), driven by
the engine's round. Each row is its own `target.generate`; a draft process that dies leaves the
batch to the target alone, output unchanged; a row's own failure there fails that row only. (A
sampled batch draws there what it draws on a thread: `tests/lossless/test_batched.py`.)"""

from __future__ import annotations

import copy
import math
import os
import signal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_parallel import PROCESS_ADAPTERS, _process_build, no_leaks  # noqa: F401 - a fixture

from hippo.testing import models as hm
from hippo.testing import reference as hr
from hippo.testing.batch import assert_batch_lossless
from hippo.testing.strategies import examples

pytestmark = pytest.mark.xdist_group("processes")  # draft processes: one worker, one test at a time

PROCESS = {"executor": "process", "executor_options": {"timeout": 60}}


def prompts(target) -> list[hm.Prompt]:
    """Three prompts of different videos and lengths."""
    unit, words = hm.pixel_unit(target), hm.text_ids(target)
    return [
        hm.Prompt("qwen2_5_vl", target, (2, 2 * unit, 2 * unit), 0, words[3:6], words[7:9]),
        hm.Prompt("qwen2_5_vl", target, (1, unit, 2 * unit), 1, words[3:4], words[7:12]),
        hm.Prompt("qwen2_5_vl", target, (3, 2 * unit, unit), 2, [], words[1:3]),
    ]


def in_process(out) -> bool:
    return any("beside the target in its own process" in n for n in out.stats.notes)


@pytest.mark.parametrize("scheduler", ["pearl", "hippo"])
def test_a_batch_drafts_in_the_draft_process_and_each_row_is_its_own_generate(
    scheduler,
    corrupting_drafter,
    no_leaks,  # noqa: F811
):
    """Rows of different lengths and budgets (one leaves early), a twin of the target as the draft
    with a corrupted third token: pre-verify rounds, post-verify blocks accepted whole and in part,
    all drafted in the draft process; then a second batch reuses that process."""
    target = hm.tiny("qwen2_5_vl", "target")
    rows = prompts(target)
    gens = [{"do_sample": False, "max_new_tokens": m} for m in (16, 3, 20)]
    refs = [hr.reference(target, p.inputs, **g) for p, g in zip(rows, gens)]
    pipe = hr.build_pipeline(
        target, copy.deepcopy(target), scheduler=scheduler, gamma=3, keep_ratio=0.5, executor=PROCESS,
        drafter=corrupting_drafter, drafter_options={"wrong": (0, 0, 1)},
    )  # fmt: skip
    blocks = {"pre": 0, "post": 0, "post partial": 0}
    pids = set()
    for _ in range(2):
        outs = pipe.generate_batch([p.inputs for p in rows], per_row=gens)
        pids.add(pipe.scheduler.executor.pid)
        for out, ref, p in zip(outs, refs, rows):
            hr.assert_same(out, ref, p.length)
            assert in_process(out) and not out.stats.fallback, out.stats.notes
            assert out.stats.seconds_draft_prefill > 0
            for d, a in zip(out.stats.drafted_per_round, out.stats.accepted_per_round):
                blocks["pre"] += d == 1
                blocks["post"] += d > 1
                blocks["post partial"] += 0 < a < d and d > 1
    assert len(pids) == 1 and None not in pids  # one draft process, reused
    assert blocks["pre"] and blocks["post"] and blocks["post partial"], blocks
    pipe.close()
    assert pipe.scheduler.executor.pid is None


def test_a_batch_whose_draft_process_dies_goes_on_with_the_target_alone(monkeypatch, no_leaks):  # noqa: F811
    """kill -9 of the draft process a few rounds in: every row still is its own `target.generate`,
    marked as a fallback; the next batch starts a fresh draft process and drafts again."""
    from hippo.plugins import process_executor

    target = hm.tiny("qwen2_5_vl", "target")
    rows = prompts(target)
    gens = [{"do_sample": False, "max_new_tokens": m} for m in (14, 9, 18)]
    refs = [hr.reference(target, p.inputs, **g) for p, g in zip(rows, gens)]
    pipe = hr.build_pipeline(target, copy.deepcopy(target), scheduler="pearl", gamma=3, executor=PROCESS)
    calls = {"n": 0}
    original = process_executor.ProcessBatchDraft.draft

    def draft_then_die(self, bases, gammas):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(self.dp.proc.pid, signal.SIGKILL)
        return original(self, bases, gammas)

    monkeypatch.setattr(process_executor.ProcessBatchDraft, "draft", draft_then_die)
    outs = pipe.generate_batch([p.inputs for p in rows], per_row=gens)
    for out, ref, p in zip(outs, refs, rows):
        hr.assert_same(out, ref, p.length)
        assert out.stats.fallback and any("draft failed" in n for n in out.stats.notes), out.stats.notes
    assert calls["n"] >= 3
    monkeypatch.undo()
    again = pipe.generate_batch([p.inputs for p in rows], per_row=gens)
    for out, ref, p in zip(again, refs, rows):
        hr.assert_same(out, ref, p.length)
        assert in_process(out) and not out.stats.fallback
    pipe.close()


def test_a_rows_own_failure_in_the_draft_process_fails_that_row_only(no_leaks):  # noqa: F811
    """A row whose draft sampler raises in the draft process leaves with that error on `job.error`;
    the other rows go on, drafted there, and are their own `target.generate`."""
    target = hm.tiny("qwen2_5_vl", "target")
    rows = prompts(target)
    gens = [{"do_sample": False, "max_new_tokens": n} for n in (10, 12)] + [
        {"do_sample": True, "max_new_tokens": 10}
    ]
    pipe = hr.build_pipeline(target, copy.deepcopy(target), scheduler="pearl", gamma=3, executor=PROCESS)
    jobs = [pipe.job(p.inputs, **g) for p, g in zip(rows, gens)]
    broken = jobs[2].policy.fork()  # the draft's own policy, which travels to the draft process
    broken.draft_token = math.sqrt  # raises TypeError there
    jobs[2].policy.fork = lambda: broken
    engine = pipe.engine()
    finished = []
    for job in jobs:
        engine.add(job)
    assert engine.remote is not None
    while engine.live:
        finished += engine.step()
    engine.close()
    assert isinstance(jobs[2].error, TypeError) and finished.index(jobs[2]) == 0
    for job, p, g in zip(jobs[:2], rows, gens):
        assert job.error is None and job.tokens == hr.new_tokens(
            hr.reference(target, p.inputs, **g), p.length
        )
        assert not job.stats.fallback
    pipe.close()


def test_process_batches_in_the_harness(monkeypatch, no_leaks):  # noqa: F811
    """hippo.testing's batch check with the draft rows in the draft process: `pearl` and `hippo`,
    every adapter's tiny pair, γ, keep ratio and corrupted drafts drawn, rows joining mid-flight
    (a join in the draft process while others draft there) and cancelled (a select there)."""
    from hippo.plugins import process_executor

    calls = {"join": 0, "draft": 0, "select": 0}
    for name in calls:
        original = getattr(process_executor.ProcessBatchDraft, name)

        def counted(self, *args, _name=name, _original=original):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(process_executor.ProcessBatchDraft, name, counted)
    result = assert_batch_lossless(
        _process_build,
        adapters=PROCESS_ADAPTERS,
        examples=max(6, examples(0.3)),
        executors=("process",),
        draws={"scheduler": st.sampled_from(["hippo", "pearl"]), "prune": st.sampled_from(["late", "early"])},
    )
    assert result.examples and result.joined_live and result.cancelled, result.summary()
    assert all(calls.values()), calls  # rows joined, drafted and left in the draft process


@settings(max_examples=max(25, examples(0.5)), deadline=None)
@given(data=st.data())
def test_draft_rows_hold_what_a_fresh_draft_holds(data):
    """`DraftRows` (what the draft process holds), driven as the round drives it, in this process:
    rows join, draft after continuations that keep part of their last chain and add a token of p's,
    and leave in any order. After every drafting, each row's chain is q's greedy chain from a new
    prefill after its tokens, and its cache row holds its pruned prompt and exactly the tokens q
    consumed (the last drafted token never fed)."""
    from hippo.engine import DraftRows

    target = hm.tiny("qwen2_5_vl", "target")
    draft = hm.tiny("qwen2_5_vl", "draft")
    pipe = hr.build_pipeline(target, draft, scheduler="serial", gamma=3, keep_ratio=0.5)
    pool = prompts(target)
    vocab = int(draft.config.get_text_config().vocab_size)
    rows = DraftRows(pipe.drafter, pipe.sessions["draft"], draft)
    live: list[dict] = []  # per row: its job, prompt length in q's cache, tokens emitted after it

    def fresh_chain(row: dict, gamma: int) -> list[int]:
        job = row["job"]
        side = job.new_draft_side()
        side.prefill(job.kept)
        emitted = row["emitted"]
        last = side.session.forward(torch.tensor(emitted))[-1] if emitted else side.session.last_logits
        chain: list[int] = []
        for _ in range(gamma):
            x, _ = job.policy.draft_token(torch.cat([job.prompt_ids, torch.tensor(emitted + chain)]), last)
            chain.append(x)
            last = side.session.forward(torch.tensor([x]))[-1]
        return chain

    joined = 0
    for step in range(data.draw(st.integers(4, 12), label="steps")):
        op = data.draw(st.sampled_from(["join", "draft", "draft", "leave"]), label=f"op {step}")
        if op == "join" or not live:
            p = pool[joined % len(pool)]
            joined += 1
            job = pipe.job(p.inputs, max_new_tokens=30)
            rows.join(job.new_draft_side().prefill(job.prune()), job.prompt_ids, job.policy)
            first = data.draw(st.integers(0, vocab - 1), label="p's first token")
            live.append({"job": job, "prompt": rows.cache.lengths[-1], "emitted": [first]})
        elif op == "leave" and len(live) > 1:
            keep = sorted(
                data.draw(st.sets(st.integers(0, len(live) - 1), min_size=1, max_size=len(live) - 1))
            )
            rows.select(keep)
            live = [live[i] for i in keep]
        else:
            gammas = [data.draw(st.integers(0, 4), label=f"γ {b}") for b in range(len(live))]
            _, chains, _, _, errors = rows.draft([r["emitted"] for r in live], gammas)
            assert errors == [None] * len(live)
            for b, (row, chain, g) in enumerate(zip(live, chains, gammas)):
                assert chain == fresh_chain(row, g), (b, row["emitted"], chain)
                consumed = row["emitted"] + chain[: max(g - 1, 0)]
                if g:
                    assert rows.rows[b].draft_generated == consumed
                    assert rows.cache.lengths[b] == row["prompt"] + len(consumed)
                kept = data.draw(st.integers(0, len(chain)), label=f"accepted {b}")
                nxt = data.draw(st.integers(0, vocab - 1), label=f"p's token {b}")
                row["emitted"] = row["emitted"] + chain[:kept] + [nxt]
