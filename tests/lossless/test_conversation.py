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

from hippo.testing import assert_conversation_lossless, corrupting_plugin
from hippo.testing import models as hm
from hippo.testing import params as hp
from hippo.testing import reference as hr
from hippo.testing import strategies as hs
from hippo.testing.sampling import SECOND_TURN, LawCheck, generation, second_turn_law, second_turn_prompts

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
            "selector, scorer": st.sampled_from(hr.supported_pairs(adapter)),
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


def test_second_turn_samples_the_target_law():
    """Turn 2 of a conversation (turn 1 answered greedily), sampled from one cached context: the
    law of its first tokens is the target's exact law on the whole turn-2 prompt, checked with the
    law test's power (`LawCheck`: runs for power >= 0.95 against a TV error of 0.05, level 4e-5;
    `python -m hippo.testing.sampling` lists it). The target drafts for itself from half the video and
    each drafting's second token is replaced by q's second choice, so draftings are accepted in
    part (the vacuity guard)."""
    case, answer, second = second_turn_prompts()
    target, first = case.target, case.prompt
    check = LawCheck.plan(second_turn_law())
    with corrupting_plugin() as corrupting:
        pipe = hr.build_pipeline(
            target,
            target,
            scheduler=SECOND_TURN["scheduler"],
            gamma=3,
            keep_ratio=case.keep_ratio,
            drafter=corrupting,
            drafter_options={"wrong": (False, True)},
        )
        try:
            ctx = pipe.prepare(first.inputs)
            conv = pipe.conversation(ctx)
            a1 = conv.ask(
                first.inputs["input_ids"][0, ctx.length :],
                max_new_tokens=SECOND_TURN["answer"],
                do_sample=False,
            )
            assert hr.new_tokens(a1.sequences, first.length) == answer  # target.generate's greedy answer
            lo, hi = SECOND_TURN["question"]
            question = torch.tensor(hm.text_ids(target)[lo:hi])
            gen = generation(
                SECOND_TURN["temperature"], SECOND_TURN["top_k"], None, None, SECOND_TURN["new_tokens"]
            )
            for run in range(check.runs):
                conv.turns = conv.turns[:1]
                out = conv.ask(question, seed=run, **gen)
                assert torch.equal(out.sequences[0, : second.length], second.inputs["input_ids"][0])
                failure = check.add(hr.new_tokens(out.sequences, second.length), out.stats)
                assert failure is None, f"{failure}; {check.details()}"
        finally:
            pipe.close()
    check.require_partial()
    res = check.result
    print(res.summary())
    assert res.power >= 0.95 and res.runs == check.runs == res.looks[-1], res.summary()
