"""Sampling is lossless in law: the pipeline's first tokens follow exactly the target's distribution.

The support is made small (top_k=2, temperature 1.5, 4 new tokens: at most 16 outcomes) so the
exact joint law can be enumerated from the target's own forward passes, processed with the same
warpers `generate` applies. N seeded pipeline runs must then be within a total-variation bound.
With 4 tokens the serial scheduler drafts γ=2 then γ=1 after the first token (taken from the
prefill), so full acceptance + bonus, partial acceptance and rejection all occur.
"""

from __future__ import annotations

import math

import harness as h
import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

ADAPTERS = h.adapter_params()
TEMPERATURE, TOP_K, NEW = 1.5, 2, 4
GEN = {"do_sample": True, "temperature": TEMPERATURE, "top_k": TOP_K, "max_new_tokens": NEW}
N = 20 * h.examples(1.0)  # pipeline runs per configuration: 600 with the ci profile, 120 with dev
DELTA = 1e-3


def warpers() -> LogitsProcessorList:
    """What `generate` builds for these settings (temperature, then top-k; top_p=1 adds nothing)."""
    return LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K)])


def tv_threshold(k: int, n: int, delta: float = DELTA) -> float:
    """A bound that n samples from a k-outcome law exceed in total variation with probability <= delta.

    E[TV] = 1/2 sum_j E|p^_j - p_j| <= 1/2 sum_j sqrt(p_j (1 - p_j) / n) <= 1/2 sqrt(k / n)
    (Jensen, then Cauchy-Schwarz). TV changes by at most 1/n when one sample changes, so McDiarmid
    gives P(TV >= E[TV] + t) <= exp(-2 n t^2); t = sqrt(ln(1/delta) / (2n)).
    Seeds are fixed, so the test is deterministic; delta is the chance that a correct sampler fails
    it for a given seed set. (k=16, n=600: 0.082 + 0.076 = 0.16.)
    """
    return 0.5 * math.sqrt(k / n) + math.sqrt(math.log(1 / delta) / (2 * n))


def prompt(adapter: str) -> h.Prompt:
    target = h.tiny(adapter)
    unit, words = h.pixel_unit(target), h.text_ids(target)
    return h.Prompt(adapter, target, (2, 2 * unit, 2 * unit), 0, words[10:13], words[20:22])


_LAWS: dict[str, dict[tuple[int, ...], float]] = {}


def law_of(adapter: str) -> dict[tuple[int, ...], float]:
    if adapter not in _LAWS:
        target = h.tiny(adapter)
        _LAWS[adapter] = h.exact_law(target, prompt(adapter).inputs, NEW, warpers(), set(h.eos_ids(target)))
    return _LAWS[adapter]


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_exact_law_is_what_generate_computes(adapter):
    """The enumeration's logits and warpers agree with what `generate` used when it sampled."""
    target, p = h.tiny(adapter), prompt(adapter)
    torch.manual_seed(0)
    out = h.reference(
        target, p.inputs, **GEN, output_logits=True, output_scores=True, return_dict_in_generate=True
    )
    tokens = h.new_tokens(out.sequences, p.length)
    for i in range(len(tokens)):
        raw = h.next_logits(target, p.inputs, tokens[:i])  # [V], forced along the sampled path
        torch.testing.assert_close(raw, out.logits[i][0], rtol=0, atol=0)
        seq = out.sequences[:, : p.length + i]
        ours = torch.softmax(warpers()(seq, raw[None].double())[0], -1)  # [V] float64
        theirs = torch.softmax(out.scores[i][0].double(), -1)  # [V] generate's processed scores
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    law = law_of(adapter)
    assert abs(sum(law.values()) - 1.0) < 1e-12
    assert 4 < len(law) <= TOP_K**NEW
    assert tuple(tokens) in law


CORRUPT = {"wrong": (True, False, True), "rank": 1}  # replace x_1 and x_3 by q's second choice


def configs() -> dict[str, dict]:
    """From the registry: every target-only scheduler; every drafting scheduler with the tiny draft
    (natural rejections) and with the pruned target as its own draft plus corrupted positions (q
    close to p, so a wrong residual or acceptance rule would show)."""
    out: dict[str, dict] = {}
    for s in h.names("schedulers"):
        if not h.part_class("schedulers", s).needs_draft:
            out[s] = dict(scheduler=s)
            continue
        out[f"{s}-draft"] = dict(scheduler=s, draft="draft", gamma=3, keep_ratio=0.5)
        for ex in h.executor_choices(s)[1:]:  # the overlapped in-process executor too
            out[f"{s}-draft-thread"] = dict(scheduler=s, draft="draft", gamma=3, keep_ratio=0.5, executor=ex)
        out[f"{s}-self-corrupting"] = dict(scheduler=s, draft="self", gamma=3, keep_ratio=0.25, corrupt=True)
    return out


def sampling_params() -> list:
    """Every configuration on one reference adapter; one configuration on each other adapter (the
    rules under test do not depend on the backbone; its p and q are covered by the greedy tests)."""
    adapters = [p for p in ADAPTERS if not p.marks]
    names = [p.values[0] for p in adapters]
    reference = "qwen2_5_vl" if "qwen2_5_vl" in names else names[0]
    everywhere = "serial-self-corrupting" if "serial-self-corrupting" in configs() else sorted(configs())[-1]
    return [
        pytest.param(a, c, id=f"{a}-{c}")
        for a in names
        for c in sorted(configs())
        if a == reference or c == everywhere
    ]


@pytest.mark.parametrize(("adapter", "config"), sampling_params())
def test_pipeline_samples_the_target_law(adapter, config, corrupting_drafter):
    opts = dict(configs()[config])
    target = h.tiny(adapter)
    role = opts.pop("draft", None)
    draft = {None: None, "self": target, "draft": h.tiny(adapter, "draft", 1)}[role]
    if opts.pop("corrupt", False):
        opts.update(drafter=corrupting_drafter, drafter_options=CORRUPT)
    pipe = h.build(target, draft, **opts)
    p, law = prompt(adapter), law_of(adapter)

    samples, rounds = [], []
    for seed in range(N):
        out = pipe.generate(p.inputs, seed=seed, **GEN)
        samples.append(tuple(h.new_tokens(out.sequences, p.length)))
        rounds.extend(zip(out.stats.accepted_per_round, out.stats.drafted_per_round))

    impossible = sorted({s for s in samples if s not in law})
    assert not impossible, f"sampled sequences the target cannot emit: {impossible[:5]}"
    tv, bound = h.total_variation(law, samples), tv_threshold(len(law), N)
    assert tv <= bound, f"TV {tv:.4f} > {bound:.4f} over {N} runs ({len(law)} outcomes)"
    if draft is not None:  # the rejection path was exercised: some drafted tokens were rejected
        assert any(n < g for n, g in rounds), f"no rejection in {len(rounds)} rounds"
    if role == "self":  # and the uncorrupted positions of a pruned self-draft got accepted
        assert any(n > 0 for n, _ in rounds), f"no accepted draft token in {len(rounds)} rounds"


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_seeded_runs_are_reproducible(adapter):
    target, p = h.tiny(adapter), prompt(adapter)
    pipe = h.build(target, target, gamma=3, keep_ratio=0.25)
    gen = {"do_sample": True, "max_new_tokens": 12}

    def run(**seeding) -> tuple[int, ...]:
        return tuple(h.new_tokens(pipe.generate(p.inputs, **seeding, **gen).sequences, p.length))

    first = [run(seed=s) for s in range(4)]
    assert first == [run(seed=s) for s in range(4)], "same seed, different sequence"
    assert first == [run(generator=torch.Generator().manual_seed(s)) for s in range(4)]
    assert len(set(first)) > 1, "four seeds gave the same 12-token sample"
