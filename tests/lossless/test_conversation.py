"""Questions from a cached video context are lossless: every answer equals `target.generate` on its
turn's whole prompt (the video, the earlier questions and answers, the question), greedy and sampled.

hypothesis draws 1-4 questions and their lengths, conversation or independent questions, the
scheduler, the selector/scorer pair, γ, the keep ratio, the executor and the stops, on every adapter
(Qwen3-VL's deepstack, LLaVA-OneVision's 1-D positions, video-SALMONN 2+'s audio included).
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

from hippo.testing import assert_conversation_lossless
from hippo.testing import models as hm
from hippo.testing import params as hp
from hippo.testing import reference as hr
from hippo.testing import strategies as hs
from hippo.testing.sampling import second_turn_coupled

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


def test_a_later_turn_draws_what_generate_draws():
    """Turn 2 of a conversation (turn 1 answered greedily, equal to `target.generate`'s answer),
    sampled from one cached context, draws seed by seed what `generate` draws on the whole turn-2
    prompt (`sampling.second_turn_coupled`: 59 seeds, power >= 0.95 against a turn whose law is at TV
    0.05 from it). The target drafts for itself from half the video and each drafting's second token
    is replaced by q's second choice, so draftings are accepted in part (the vacuity guard)."""
    res = second_turn_coupled()
    print(res.summary())
    assert res.power >= 0.95 and res.runs == res.planned and res.distinct > 1, res.summary()
    assert res.partial_rounds > 0
