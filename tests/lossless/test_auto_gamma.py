"""`gamma="auto"`: γ from the cost model (hippo.cost) is lossless under every drafting scheduler.

- greedy: the hypothesis harness on every adapter, the drafting scheduler and the executor drawn,
  float64, against `target.generate`; γ changes from round to round with measured times and
  acceptance;
- hippo's synchronous-prefill buffer is verified in chunks, still exactly;
- sampling: the target's exact law, checked with power in test_sampling.py (LAW_CONFIGS: serial and
  hippo with gamma="auto");
- the cost model itself: expected tokens, the best γ, the verify curve, and a calibration that
  leaves the target's cache as it found it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from hippo.cost import GAMMA_MAX, GAMMA_START, VerifyCurve, best_gamma, expected_tokens, measure_verify_curve
from hippo.testing import assert_greedy_lossless
from hippo.testing import models as hm
from hippo.testing import params as hp
from hippo.testing import reference as hr
from hippo.testing import strategies as hs

ADAPTERS = hp.adapter_params()


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_auto_gamma_equals_target_generate(adapter):
    """The harness with γ="auto" on every drafting scheduler (drawn), the tiny draft or the target
    itself, corrupted drafts, the verifier and every in-process executor drawn."""

    def build(case):
        return case.builder(case.extra["scheduler"], verifier=case.extra["verifier"])

    def check(case, out):
        s = out.stats
        assert all(0 <= n <= g <= GAMMA_MAX for n, g in zip(s.accepted_per_round, s.drafted_per_round))

    assert_greedy_lossless(
        build,
        adapters=[adapter],
        examples=hs.examples(0.5),
        gamma=st.just("auto"),
        draws={
            "scheduler": st.sampled_from(hm.drafting_schedulers()),
            "verifier": st.sampled_from([None, "rejection"]),
        },
        on_output=check,
    )


def test_the_curve_is_measured_once_per_pipeline():
    adapter = "qwen2_5_vl"
    target = hm.tiny(adapter)
    p = hm.Prompt.default(adapter, target)
    pipe = hr.build_pipeline(target, target, scheduler="serial", gamma="auto", keep_ratio=0.5)
    gen = {"do_sample": False, "max_new_tokens": 10}
    ref = hr.reference(target, p.inputs, **gen)
    hr.assert_same(pipe.generate(p.inputs, **gen), ref, p.length)
    curve = pipe.scheduler.auto.curve
    assert curve is not None and curve.ks[0] == 1 and curve.ks[-1] == GAMMA_MAX + 1
    hr.assert_same(pipe.generate(p.inputs, **gen), ref, p.length)
    assert pipe.scheduler.auto.curve is curve


def test_hippo_verifies_its_prefill_buffer_in_chunks():
    """A slow target prefill lets the draft buffer 30 tokens; `auto` verifies them in γ-sized
    chunks (the first γ before any draft timing is GAMMA_START), with the same output."""
    adapter = "qwen2_5_vl"
    target = hm.tiny(adapter)
    p = hm.Prompt.default(adapter, target)
    slow = {"target_prefill": 50.0, "target_forward": 5.0, "draft_prefill": 1.0, "draft_forward": 1.0}
    ex = {"executor": "simulated", "executor_options": slow}
    gen = {"do_sample": False, "max_new_tokens": 30}
    out = hr.build_pipeline(
        target, target, scheduler="hippo", gamma="auto", keep_ratio=1.0, executor=ex
    ).generate(p.inputs, **gen)
    hr.assert_same(out, hr.reference(target, p.inputs, **gen), p.length)
    s = out.stats
    assert s.drafted_per_round[0] == GAMMA_START < 30, s.as_dict()
    assert s.accepted_per_round[0] == GAMMA_START  # the draft is the target: the chunk is accepted


# ---- the cost model -------------------------------------------------------------------------------


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_verify_curve_interpolates_and_extends():
    curve = VerifyCurve({1: 1.0, 2: 1.2, 8: 2.4})
    assert curve(1) == 1.0 and curve(0) == 1.0
    assert curve(5) == pytest.approx(1.8)
    assert curve(10) == pytest.approx(2.8)  # the last segment's slope, continued
    assert VerifyCurve({4: 2.0})(8) == pytest.approx(4.0)


def test_best_gamma_follows_costs_and_acceptance():
    flat = VerifyCurve({1: 1.0, 17: 1.0})  # verifying 17 tokens costs one decode step (a GPU)
    steep = VerifyCurve({1: 1.0, 17: 17.0})  # every verified token costs a step
    assert best_gamma(flat, 0.9, 0.01, parallel=False) > best_gamma(steep, 0.9, 0.01, parallel=False)
    assert best_gamma(flat, 0.99, 0.001, parallel=False) == GAMMA_MAX
    assert best_gamma(flat, 0.01, 0.5, parallel=False) == 1  # nothing is accepted: draft little
    # q drafts while p verifies: the round lasts max(γ·t_draft, t_verify), so γ grows until the
    # drafting takes as long as the verification (5 x 0.2 s = 1 s), and no further
    assert best_gamma(flat, 0.9, 0.2, parallel=True) == 5


def test_calibration_leaves_the_target_as_it_found_it():
    adapter = "qwen2_5_vl"
    target = hm.tiny(adapter)
    ad = hm.part_class("adapters", adapter)(target)
    encoded = ad.encode(hm.Prompt.default(adapter, target).inputs)
    words = torch.tensor(hm.text_ids(target)[30:34])
    measured = ad.prefill(encoded, None)
    curve = measure_verify_curve(measured, encoded.input_ids.cpu(), widths=(1, 3), repeats=1)
    assert curve.ks == [1, 3] and all(t > 0 for t in curve.seconds.values())
    assert measured.length == encoded.length and measured.generated == []
    fresh = ad.prefill(encoded, None)
    torch.testing.assert_close(measured.last_logits, fresh.last_logits, rtol=0, atol=0)
    torch.testing.assert_close(measured.forward(words), fresh.forward(words), rtol=0, atol=0)
