"""A finished job frees its caches at once: no reference cycle holds it.

Python frees an object when its last reference goes, except inside a reference cycle, which waits
for the cyclic collector. That collector runs by counts of Python allocations, and knows nothing of
the megabytes a tensor holds: a job caught in a cycle (its KV caches, its vision encoding, a tree's
draft laws) stays resident for many more jobs. `hippo bench --long` reached 6.9 GB that way, where
0.9 GB are live. Each case here runs a job twice and checks that the second left no hippo object
and no tensor to the cyclic collector.
"""

from __future__ import annotations

import gc
import queue

import pytest
import torch

from hippo.testing.models import Prompt, pixel_unit, text_ids
from hippo.testing.reference import build_pipeline

ADAPTER = "qwen2_5_vl"


def cyclic_garbage(run) -> list[str]:
    """The hippo objects and tensors that only the cyclic collector frees after `run()` (run once
    before, untimed, so that lazily built state, caches of compiled or packed models, are not
    counted)."""
    run()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        found = [
            type(o).__qualname__
            for o in gc.garbage
            if torch.is_tensor(o) or type(o).__module__.split(".")[0] == "hippo"
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


@pytest.fixture(scope="module")
def setup(tiny):
    target, draft = tiny(ADAPTER), tiny(ADAPTER, "draft", seed=1)
    unit, words = pixel_unit(target), text_ids(target)
    prompts = [
        Prompt(
            ADAPTER, target, (1 + s % 2, 2 * unit, 2 * unit), s, words[10 + s : 13 + s], words[20:22]
        ).inputs
        for s in range(3)
    ]
    return target, draft, prompts, words


CASES = {
    "serial": dict(scheduler="serial"),
    "self-speculation, holistic": dict(scheduler="serial", scorer="holistic", self_spec=True),
    "pearl, draft on a thread": dict(scheduler="pearl"),
    "hippo, draft on a thread": dict(scheduler="hippo", scorer="holistic"),
    "auto": dict(scheduler="auto"),
    "tree": dict(scheduler="serial", drafter="tree"),
}


def runs(pipe, prompts, words, batch: bool):
    """Greedy, sampled and (where the schedule has a batched form) batched jobs, and a prepared video
    with a question and a conversation's two turns."""

    def run() -> None:
        pipe.generate(prompts[0], max_new_tokens=10, do_sample=False)
        pipe.generate(prompts[0], max_new_tokens=10, do_sample=True, seed=3)
        if batch:
            pipe.generate_batch(prompts, max_new_tokens=10, do_sample=False)
        ctx = pipe.prepare(prompts[1])
        pipe.ask(ctx, words[5:8], max_new_tokens=6)
        conversation = pipe.conversation(ctx)
        for question in (words[5:8], words[8:10]):
            conversation.ask(question, max_new_tokens=4)
        ctx.close()

    return run


@pytest.mark.parametrize("case", CASES)
def test_a_finished_job_leaves_no_cycle(setup, case):
    target, draft, prompts, words = setup
    options = dict(CASES[case])
    pipe = build_pipeline(target, target if options.pop("self_spec", False) else draft, **options)
    try:
        assert cyclic_garbage(runs(pipe, prompts, words, batch=options.get("drafter") != "tree")) == []
    finally:
        pipe.close()


@pytest.mark.xdist_group("processes")
def test_a_finished_job_leaves_no_cycle_with_a_draft_process(setup):
    target, draft, prompts, words = setup
    pipe = build_pipeline(target, draft, scheduler="hippo", executor={"executor": "process"})
    try:
        assert cyclic_garbage(runs(pipe, prompts, words, batch=True)) == []
    finally:
        pipe.close()


def test_a_served_request_leaves_no_cycle(tmp_path):
    """`hippo serve`'s loop: a ticket streams from its job; once answered, neither holds the other."""
    from tiny_checkpoint import save_checkpoint, tiny_tokenizer, write_video

    import hippo
    from hippo.service import Request, Service

    target = save_checkpoint(tmp_path / "target", dtype=torch.float64)
    draft = save_checkpoint(tmp_path / "draft", role="draft", seed=1, dtype=torch.float64)
    videos = [write_video(tmp_path / f"v{i}.mp4", n=8, fps=8) for i in range(2)]
    pipe = (
        hippo.PipelineBuilder()
        .target(str(target), dtype=torch.float64)
        .draft(str(draft), dtype=torch.float64)
    )
    service = Service(pipe.scheduler("serial", gamma=3).build(), tiny_tokenizer())
    done: queue.SimpleQueue = queue.SimpleQueue()
    service.on_round = lambda s: None if s.live else done.put(s.rounds)

    def ask(video) -> None:
        ticket = service.submit(
            Request(
                str(video),
                [("what happens ?", None)],
                {"frames": 2, "max_pixels": 3136},
                {"max_new_tokens": 6},
            )
        )
        while (event := ticket.events.get(timeout=60))[0] not in ("end", "error"):
            pass
        assert event[0] == "end", event
        done.get(timeout=60)  # the loop's round that ended the row is over

    try:
        ask(videos[0])
        assert cyclic_garbage(lambda: ask(videos[1])) == []
    finally:
        service.close(0)
