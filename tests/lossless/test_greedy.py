"""Greedy decoding is lossless: every pipeline returns exactly `target.generate(...)`, token for token.

Adapters, schedulers, selectors and scorers come from the registries; hypothesis chooses the video,
the prompt, γ, the keep ratio, the selector, the token budget and an EOS that stops mid-way.
Float64 tiny models on CPU, so equality is exact.
"""

from __future__ import annotations

import harness as h
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

ADAPTERS = h.adapter_params()
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
    scored = [n for n in h.names("selectors") if h.part_class("selectors", n).needs_scores]
    assert not scored or h.names("scorers"), f"selectors {scored} need a scorer but none is registered"


@pytest.mark.parametrize("scheduler", h.names("schedulers"))
@pytest.mark.parametrize("adapter", ADAPTERS)
@settings(max_examples=h.examples(1.0))
@given(data=st.data())
def test_pipeline_equals_target_generate(adapter, scheduler, data):
    target = h.tiny(adapter, "target", data.draw(h.model_seeds, label="target seed"))
    draft = h.tiny(adapter, "draft", data.draw(h.model_seeds, label="draft seed"))
    prompt = data.draw(
        h.prompts(adapter, target, with_eos=data.draw(st.booleans(), label="EOS in prompt")), label="prompt"
    )
    selector, scorer = data.draw(st.sampled_from(h.selector_scorer_pairs(adapter)), label="selector, scorer")
    pipe = h.build(
        target,
        draft,
        scheduler=scheduler,
        gamma=data.draw(h.gammas, label="γ"),
        selector=selector,
        scorer=scorer,
        keep_ratio=data.draw(h.keep_ratios, label="keep ratio"),
        selector_seed=data.draw(st.none() | h.seeds, label="selector seed"),
        verifier=data.draw(verifiers, label="verifier"),
        executor=data.draw(st.sampled_from(h.executor_choices(scheduler)), label="executor"),
    )
    max_new = data.draw(h.max_new_tokens, label="max_new_tokens")
    gen = greedy(max_new)
    min_new = data.draw(st.none() | st.integers(1, max_new), label="min_new_tokens")  # no EOS before it
    if min_new is not None:
        gen["min_new_tokens"] = min_new
    gen, ref = h.eos_stop(target, prompt.inputs, gen, data.draw(eos_picks, label="EOS pick"))
    out = pipe.generate(prompt.inputs, seed=data.draw(h.seeds, label="run seed"), **gen)
    h.assert_same(out, ref, prompt.length)
    check_rounds(out)


@pytest.mark.parametrize("adapter", ADAPTERS)
@settings(max_examples=h.examples(0.5))
@given(data=st.data())
def test_self_speculation_and_interleaved_hf_generate(adapter, data):
    """The draft is the target object itself; HF `generate` runs before, between and after the
    pipeline on other prompts, so any stale per-model state (Qwen's `rope_deltas`) would show."""
    target = h.tiny(adapter, "target", data.draw(h.model_seeds, label="model seed"))
    a = data.draw(h.prompts(adapter, target), label="prompt A")
    b = data.draw(h.prompts(adapter, target), label="prompt B")
    gen_a = greedy(data.draw(h.max_new_tokens, label="max_new A"))
    gen_b, ref_b = h.eos_stop(
        target,
        b.inputs,
        greedy(data.draw(h.max_new_tokens, label="max_new B")),
        data.draw(eos_picks, label="EOS pick B"),
    )
    ref_a = h.reference(target, a.inputs, **gen_a)  # HF last ran on B: its state is B's
    selector, scorer = data.draw(st.sampled_from(h.selector_scorer_pairs(adapter)), label="selector, scorer")
    pipe = h.build(
        target,
        target,
        scheduler=data.draw(st.sampled_from(h.drafting_schedulers()), label="scheduler"),
        gamma=data.draw(h.gammas, label="γ"),
        selector=selector,
        scorer=scorer,
        keep_ratio=data.draw(h.keep_ratios, label="keep ratio"),
    )
    h.assert_same(pipe.generate(b.inputs, **gen_b), ref_b, b.length)  # after HF ran on A
    assert torch.equal(h.reference(target, b.inputs, **gen_b), ref_b)  # HF right after the pipeline
    out_a = pipe.generate(a.inputs, **gen_a)  # after HF ran on B
    h.assert_same(out_a, ref_a, a.length)
    assert torch.equal(h.reference(target, a.inputs, **gen_a), ref_a)  # HF after pipeline runs
    check_rounds(out_a)


@pytest.mark.parametrize("verifier", [None, "greedy", "rejection"])
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_partial_acceptance_is_exact(adapter, verifier, corrupting_drafter):
    """Corrupted draft positions force rounds that accept some but not all of γ; the output must
    not change. The test also checks that such rounds really happened across the examples."""
    target = h.tiny(adapter, "target")
    partial: list[tuple[int, int]] = []
    unit, words = h.pixel_unit(target), h.text_ids(target)
    known = h.Prompt(adapter, target, (4, 2 * unit, 2 * unit), 0, words[3:6], words[7:9])

    @settings(max_examples=h.examples(0.75))
    @example(prompt=known, wrong=(False, False, True), gamma=4, keep=0.5, max_new=16, scheduler="serial")
    @given(
        prompt=h.prompts(adapter, target),
        wrong=h.corrupt_patterns,
        gamma=h.gammas,
        keep=h.keep_ratios,
        max_new=h.max_new_tokens,
        scheduler=st.sampled_from(h.drafting_schedulers()),
    )
    def check(prompt, wrong, gamma, keep, max_new, scheduler):
        pipe = h.build(
            target,
            target,  # self-speculation: drafts are mostly right, so corruption decides where they fail
            scheduler=scheduler,
            gamma=gamma,
            keep_ratio=keep,
            drafter=corrupting_drafter,
            drafter_options={"wrong": wrong},
            verifier=verifier,
        )
        gen = greedy(max_new)
        out = pipe.generate(prompt.inputs, **gen)
        h.assert_same(out, h.reference(target, prompt.inputs, **gen), prompt.length)
        check_rounds(out)
        partial.extend(h.partial_rounds(out))

    check()
    assert partial, "no round accepted some but not all of its draft tokens: the partial path was not reached"


@pytest.mark.parametrize(("adapter", "selector", "scorer"), h.combination_params())
@settings(max_examples=max(2, h.examples(0.25)))
@given(data=st.data())
def test_keeping_every_visual_token(adapter, selector, scorer, data):
    """keep_ratio=1 (or a keep-all selector) with the target as its own draft: the draft's prefill is
    the target's, so every draft token is accepted, and the output is still the target's."""
    target = h.tiny(adapter, "target", data.draw(h.model_seeds, label="model seed"))
    prompt = data.draw(h.prompts(adapter, target), label="prompt")
    pipe = h.build(
        target,
        target,
        scheduler=data.draw(st.sampled_from(h.drafting_schedulers()), label="scheduler"),
        gamma=data.draw(h.gammas, label="γ"),
        selector=selector,
        scorer=scorer,
        keep_ratio=1.0,
    )
    gen = greedy(data.draw(st.integers(2, 24), label="max_new_tokens"))
    out = pipe.generate(prompt.inputs, **gen)
    h.assert_same(out, h.reference(target, prompt.inputs, **gen), prompt.length)
    s = out.stats
    if out.kept_visual_index is None:  # stopped (EOS) before the draft was needed
        assert s.rounds == 0
        return
    if "keep_ratio" in h.config_fields(h.part_class("selectors", selector)):
        assert s.kept_visual_tokens == s.visual_tokens, "keep_ratio=1.0 must keep every visual token"
    if s.kept_visual_tokens == s.visual_tokens:
        assert s.accepted_per_round == s.drafted_per_round, "a draft equal to the target was rejected"
