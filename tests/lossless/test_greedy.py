"""Greedy decoding is lossless: every pipeline returns exactly `target.generate(...)`, token for token.

Adapters, schedulers, selectors and scorers come from the registries; hypothesis chooses the video,
the prompt, γ, the keep ratio, the selector, the token budget and an EOS that stops mid-way.
Float64 tiny models on CPU, so equality is exact.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hippo.testing import Case, assert_greedy_lossless, replay_greedy
from hippo.testing import models as hm
from hippo.testing import params as hp
from hippo.testing import reference as hr
from hippo.testing import strategies as hs
from hippo.testing.greedy import partial_case

ADAPTERS = hp.adapter_params()
verifiers = st.sampled_from([None, "greedy", "rejection"])
eos_picks = st.none() | st.integers(0, 23)


def greedy(max_new: int) -> dict:
    return {"do_sample": False, "max_new_tokens": max_new}


def check_rounds(out) -> None:
    s = out.stats
    assert len(s.accepted_per_round) == len(s.drafted_per_round) == s.rounds
    assert all(0 <= n <= g for n, g in zip(s.accepted_per_round, s.drafted_per_round))
    assert len(s.emitted_per_round) == len(s.rejected_per_round) == s.rounds
    assert all(e <= n + 1 for n, e in zip(s.accepted_per_round, s.emitted_per_round))
    # only the last round can be cut short (token budget or EOS), keeping fewer than it accepted
    assert all(n <= e for n, e in zip(s.accepted_per_round[:-1], s.emitted_per_round[:-1]))
    assert sum(s.emitted_per_round) <= s.new_tokens  # the rest came from plain target steps
    assert s.mat_accumulated >= s.mat or not s.rounds


def test_every_scored_selector_has_a_scorer():
    """A selector that needs scores is only tested paired with a scorer: there must be one."""
    scored = [n for n in hm.names("selectors") if hm.part_class("selectors", n).needs_scores]
    assert not scored or hm.names("scorers"), f"selectors {scored} need a scorer but none is registered"


@pytest.mark.parametrize("scheduler", hm.names("schedulers"))
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_pipeline_equals_target_generate(adapter, scheduler):
    """The public check (hippo.testing.assert_greedy_lossless) on every adapter x scheduler, drawing
    the selector/scorer pair, the verifier and the in-process executor on top of the case; drafts
    by the tiny draft or the target itself, with corrupted positions, so that rounds accept part
    of their draft (the check fails if none did)."""

    def build(case):
        selector, scorer = case.extra["selector, scorer"]
        return case.builder(scheduler, selector=selector, scorer=scorer, verifier=case.extra["verifier"])

    assert_greedy_lossless(
        build,
        adapters=[adapter],
        examples=hs.examples(1.0),
        executors=("inline", "thread"),
        draws={"selector, scorer": st.sampled_from(hr.supported_pairs(adapter)), "verifier": verifiers},
        on_output=lambda case, out: check_rounds(out),
    )


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_self_speculation_and_interleaved_hf_generate(adapter, corrupting_drafter):
    """The draft is the target object itself; HF `generate` runs before, between and after the
    pipeline on other prompts, so any stale per-model state (Qwen's `rope_deltas`) would show.
    Draft positions are corrupted in some examples; some round must accept part of its draft."""
    partial = []

    @settings(max_examples=hs.examples(0.5))
    @given(data=st.data())
    def check(data):
        target = hm.tiny(adapter, "target", data.draw(hs.model_seeds, label="model seed"))
        a = data.draw(hs.prompts(adapter, target), label="prompt A")
        b = data.draw(hs.prompts(adapter, target), label="prompt B")
        gen_a = greedy(data.draw(hs.max_new_tokens, label="max_new A"))
        gen_b, ref_b = hr.eos_stop(
            target,
            b.inputs,
            greedy(data.draw(hs.max_new_tokens, label="max_new B")),
            data.draw(eos_picks, label="EOS pick B"),
        )
        ref_a = hr.reference(target, a.inputs, **gen_a)  # HF last ran on B: its state is B's
        selector, scorer = data.draw(st.sampled_from(hr.supported_pairs(adapter)), label="selector, scorer")
        wrong = data.draw(st.none() | hs.corrupt_patterns, label="corrupted positions")
        pipe = hr.build_pipeline(
            target,
            target,
            scheduler=data.draw(st.sampled_from(hm.drafting_schedulers()), label="scheduler"),
            gamma=data.draw(hs.gammas, label="γ"),
            selector=selector,
            scorer=scorer,
            keep_ratio=data.draw(hs.keep_ratios, label="keep ratio"),
            drafter="chain" if wrong is None else corrupting_drafter,
            drafter_options=None if wrong is None else {"wrong": wrong},
        )
        out_b = pipe.generate(b.inputs, **gen_b)
        hr.assert_same(out_b, ref_b, b.length)  # after HF ran on A
        assert torch.equal(hr.reference(target, b.inputs, **gen_b), ref_b)  # HF right after the pipeline
        out_a = pipe.generate(a.inputs, **gen_a)  # after HF ran on B
        hr.assert_same(out_a, ref_a, a.length)
        assert torch.equal(hr.reference(target, a.inputs, **gen_a), ref_a)  # HF after pipeline runs
        check_rounds(out_a)
        partial.extend(hr.partial_rounds(out_a) + hr.partial_rounds(out_b))

    # the fixed example first (the harness's: the target drafts, its third draft token corrupted)
    partial.extend(
        hr.partial_rounds(replay_greedy(lambda case: case.builder("serial"), partial_case(adapter)))
    )
    check()
    assert partial, "no round accepted some but not all of its draft tokens"


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_partial_acceptance_is_exact(adapter):
    """Corrupted draft positions force rounds that accept some but not all of γ; the output must
    not change. The check also fails unless such rounds really happened across the examples. The
    verifier (default, greedy, rejection) is drawn with the scheduler."""
    target = hm.tiny(adapter, "target")
    unit, words = hm.pixel_unit(target), hm.text_ids(target)
    known = Case(
        adapter,
        (4, 2 * unit, 2 * unit),
        words[3:6],
        words[7:9],
        draft="self",
        gamma=4,
        keep_ratio=0.5,
        max_new_tokens=16,
        wrong=(False, False, True),
    )

    def build(case):
        return case.builder(case.extra["scheduler"], verifier=case.extra["verifier"])

    # self-speculation: drafts are mostly right, so corruption decides where they fail
    for verifier in (None, "greedy", "rejection"):
        out = replay_greedy(lambda case, v=verifier: case.builder("serial", verifier=v), known)
        assert hr.partial_rounds(out), f"verifier {verifier}: no round accepted part of its draft"
    assert_greedy_lossless(
        build,
        adapters=[adapter],
        examples=hs.examples(0.75),
        self_draft=True,
        executors=("inline",),
        draws={"scheduler": st.sampled_from(hm.drafting_schedulers()), "verifier": verifiers},
        stops=False,  # as before the move: the token budget ends each run
        on_output=lambda case, out: check_rounds(out),
    )


@pytest.mark.parametrize("adapter", ADAPTERS)
@settings(max_examples=hs.examples(1.0))
@given(data=st.data())
def test_keeping_every_visual_token(adapter, data):
    """keep_ratio=1 (or a keep-all selector) with the target as its own draft: the draft's prefill is
    the target's, so every draft token is accepted, and the output is still the target's. The
    selector/scorer pair is drawn (each pair about twice per run with the ci profile)."""
    pairs = hr.supported_pairs(adapter)
    selector, scorer = data.draw(st.sampled_from(pairs), label="selector, scorer")
    target = hm.tiny(adapter, "target", data.draw(hs.model_seeds, label="model seed"))
    prompt = data.draw(hs.prompts(adapter, target), label="prompt")
    pipe = hr.build_pipeline(
        target,
        target,
        scheduler=data.draw(st.sampled_from(hm.drafting_schedulers()), label="scheduler"),
        gamma=data.draw(hs.gammas, label="γ"),
        selector=selector,
        scorer=scorer,
        keep_ratio=1.0,
    )
    gen = greedy(data.draw(st.integers(2, 24), label="max_new_tokens"))
    out = pipe.generate(prompt.inputs, **gen)
    hr.assert_same(out, hr.reference(target, prompt.inputs, **gen), prompt.length)
    s = out.stats
    if out.kept_visual_index is None:  # stopped (EOS) before the draft was needed
        assert s.rounds == 0
        return
    if "keep_ratio" in hm.config_fields(hm.part_class("selectors", selector)):
        assert s.kept_visual_tokens == s.visual_tokens, "keep_ratio=1.0 must keep every visual token"
    if s.kept_visual_tokens == s.visual_tokens:
        assert s.accepted_per_round == s.drafted_per_round, "a draft equal to the target was rejected"
