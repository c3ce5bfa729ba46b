"""Sampling is lossless in law: the pipeline's first tokens follow exactly the target's distribution.

The support is made small (top_k=2, temperature 1.5, 4 new tokens: at most 16 outcomes) so the
exact joint law can be enumerated from the target's own forward passes, processed with the same
warpers `generate` applies. N seeded pipeline runs must then be within a total-variation bound.
With 4 tokens the serial scheduler drafts γ=2 then γ=1 after the first token (taken from the
prefill), so full acceptance + bonus, partial acceptance and rejection all occur.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from hippo.testing import assert_sampling_exact
from hippo.testing import models as hm
from hippo.testing import params as hp
from hippo.testing import reference as hr
from hippo.testing import strategies as hs

ADAPTERS = hp.adapter_params()
TEMPERATURE, TOP_K, NEW = 1.5, 2, 4
GEN = {"do_sample": True, "temperature": TEMPERATURE, "top_k": TOP_K, "max_new_tokens": NEW}
N = hs.law_runs()  # pipeline runs per configuration: 300 with the ci profile
DELTA = 1e-3


def warpers() -> LogitsProcessorList:
    """What `generate` builds for these settings (temperature, then top-k; top_p=1 adds nothing)."""
    return LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K)])


def tv_threshold(k: int, n: int, delta: float = DELTA) -> float:
    """hippo.testing's total-variation bound (see `hippo.testing.reference.tv_threshold`)."""
    return hr.tv_threshold(k, n, delta)


def prompt(adapter: str) -> hm.Prompt:
    target = hm.tiny(adapter)
    unit, words = hm.pixel_unit(target), hm.text_ids(target)
    return hm.Prompt(adapter, target, (2, 2 * unit, 2 * unit), 0, words[10:13], words[20:22])


_LAWS: dict[str, dict[tuple[int, ...], float]] = {}


def law_of(adapter: str) -> dict[tuple[int, ...], float]:
    if adapter not in _LAWS:
        target = hm.tiny(adapter)
        _LAWS[adapter] = hr.exact_law(target, prompt(adapter).inputs, NEW, warpers(), set(hm.eos_ids(target)))
    return _LAWS[adapter]


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_exact_law_is_what_generate_computes(adapter):
    """The enumeration's logits and warpers agree with what `generate` used when it sampled."""
    target, p = hm.tiny(adapter), prompt(adapter)
    torch.manual_seed(0)
    out = hr.reference(
        target, p.inputs, **GEN, output_logits=True, output_scores=True, return_dict_in_generate=True
    )
    tokens = hr.new_tokens(out.sequences, p.length)
    for i in range(len(tokens)):
        raw = hr.next_logits(target, p.inputs, tokens[:i])  # [V], forced along the sampled path
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
    for s in hm.names("schedulers"):
        if not hm.part_class("schedulers", s).needs_draft:
            out[s] = dict(scheduler=s)
            continue
        out[f"{s}-draft"] = dict(scheduler=s, draft="draft", gamma=3, keep_ratio=0.5)
        for ex in hm.executor_choices(s)[1:]:  # the overlapped in-process executor too
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
def test_pipeline_samples_the_target_law(adapter, config):
    """The public law test (hippo.testing.assert_sampling_exact) on its enumerable setting: the TV
    bound against the exact joint law, plus the surprisal test, both at level DELTA."""
    opts = dict(configs()[config])
    scheduler, executor = opts.pop("scheduler"), opts.pop("executor", None)
    role = opts.pop("draft", None)

    def build(case):
        return case.builder(scheduler, executor=None if executor is None else "thread")

    res = assert_sampling_exact(
        build,
        adapter=adapter,
        draft=role or "self",
        gamma=opts.get("gamma", 3),
        keep_ratio=opts.get("keep_ratio", 0.5),
        corrupt=CORRUPT["wrong"] if opts.get("corrupt") else None,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        new_tokens=NEW,
        runs=N,
        sensitivity=None,
        delta=DELTA,
        require_partial=False,
    )
    assert res.outcomes == len(law_of(adapter)) and res.runs == N
    assert res.tv <= tv_threshold(len(law_of(adapter)), N), res.summary()
    if role is not None:  # the rejection path was exercised: some drafted tokens were rejected
        assert res.rejected_rounds, f"no rejection in {res.rounds} rounds"
