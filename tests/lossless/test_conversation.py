"""Questions from a cached video context are lossless: every answer equals `target.generate` on its
turn's whole prompt (the video, the earlier questions and answers, the question), greedy and sampled.

hypothesis draws 1-4 questions and their lengths, conversation or independent questions, the
scheduler, the selector/scorer pair, γ, the keep ratio, the executor and the stops, on every adapter
(Qwen3-VL's deepstack, LLaVA-OneVision's 1-D positions, video-SALMONN 2+'s audio included).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from hippo.testing import assert_conversation_lossless
from hippo.testing import models as hm
from hippo.testing import params as hp
from hippo.testing import reference as hr
from hippo.testing import strategies as hs

ADAPTERS = hp.adapter_params()
# drafting schedulers first: the harness's fixed examples take each draw's first value
SCHEDULERS = sorted(hm.names("schedulers"), key=lambda n: n not in hm.drafting_schedulers())


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_questions_equal_target_generate(adapter):
    def build(case):
        selector, scorer = case.extra["selector, scorer"]
        return case.builder(case.extra["scheduler"], selector=selector, scorer=scorer)

    ran = assert_conversation_lossless(
        build,
        adapters=[adapter],
        examples=hs.examples(0.25),
        draws={
            "scheduler": st.sampled_from(SCHEDULERS),
            "selector, scorer": st.sampled_from(hm.selector_scorer_pairs(adapter)),
        },
    )
    assert ran >= 1


@pytest.mark.xdist_group("processes")
def test_questions_with_a_draft_process_equal_target_generate():
    """The process executor's draft keeps each context's video encoding in its own process
    (`DraftPrefix`); drawn questions and conversations, pearl and hippo, every answer exact."""

    def build(case):
        return case.builder(case.extra["scheduler"])

    ran = assert_conversation_lossless(
        build,
        adapters=["qwen2_5_vl"],
        examples=max(1, hs.examples(0.05)),
        executors=("process",),
        draws={"scheduler": st.sampled_from(["hippo", "pearl"])},
    )
    assert ran >= 2  # the fixed example and at least one drawn


TEMPERATURE, TOP_K, NEW = 1.5, 2, 4
GEN = {"do_sample": True, "temperature": TEMPERATURE, "top_k": TOP_K, "max_new_tokens": NEW}
N = hs.law_runs()


# hippo only: the serial schedule's sampling law on a context goes through the same Turn and
# verification round, and tests/lossless/test_sampling.py covers serial sampling (suite time)
@pytest.mark.parametrize("scheduler", ["hippo"])
def test_second_turn_samples_the_target_law(scheduler):
    """Turn 2 of a conversation (turn 1 answered greedily), sampled N times from one context: the
    sequences' law is the target's exact law on the whole turn-2 prompt (TV bound, level 1e-3)."""
    adapter = "qwen2_5_vl"
    target, draft = hm.tiny(adapter), hm.tiny(adapter, "draft", 1)
    unit, words = hm.pixel_unit(target), hm.text_ids(target)
    grid, before, q1, q2 = (2, 2 * unit, 2 * unit), words[10:13], words[20:22], words[30:32]
    pipe = hr.build_pipeline(target, draft, scheduler=scheduler, gamma=3, keep_ratio=0.5)
    ctx = pipe.prepare(hm.Prompt(adapter, target, grid, 0, before, q1).inputs)
    first = hm.Prompt(adapter, target, grid, 0, before, q1)
    conv = pipe.conversation(ctx)
    a1 = hr.new_tokens(
        conv.ask(first.inputs["input_ids"][0, ctx.length :], max_new_tokens=3).sequences, first.length
    )
    assert a1 == hr.new_tokens(
        hr.reference(target, first.inputs, max_new_tokens=3, do_sample=False), first.length
    )
    second = hm.Prompt(adapter, target, grid, 0, before, q1 + a1 + q2)
    turn2 = torch.tensor(q2)
    samples, rejected = [], 0
    for run in range(N):
        conv.turns = conv.turns[:1]
        out = conv.ask(turn2, seed=run, **GEN)
        assert torch.equal(out.sequences[0, : second.length], second.inputs["input_ids"][0])
        samples.append(tuple(hr.new_tokens(out.sequences, second.length)))
        s = out.stats
        rejected += sum(n < g for n, g in zip(s.accepted_per_round, s.drafted_per_round))
    warp = LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K)])
    law = hr.exact_law(target, second.inputs, NEW, warp, set(hm.eos_ids(target)))
    tv, bound = hr.total_variation(law, samples), hr.tv_threshold(len(law), N, 1e-3)
    assert tv <= bound, f"TV {tv:.4f} > {bound:.4f} over {len(law)} outcomes"
    assert rejected, "no draft token was ever rejected: the rejection path was not exercised"
