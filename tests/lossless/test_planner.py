"""γ = 0 under `gamma="auto"`: the planner decodes with the target alone while drafting loses, probes
again with a back-off, and the output stays exactly the target's (float64, `target.generate`).

The costs are fixed (`costs=`), so the switches are forced and do not depend on this machine's
timing: drafting pays at the prior α = 1/2 and loses once the draft is seen to be wrong. Drafters:
- always wrong: the corrupting drafter replaces every round's first draft token;
- always right: the target drafting for itself on all its visual tokens;
- flipping: wrong, then right from the `FLIPS[0]`-th new token, wrong again from the `FLIPS[1]`-th,
  so the planner stops drafting, probes, drafts again and stops again.
Serial, and pearl / hippo with the inline executor (one after the other: q's time adds to p's),
plus hippo with the draft on a thread (q's time hidden behind p's, its own cost curve).
"""

from __future__ import annotations

import contextlib
import copy
import json

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hippo
from hippo.cli.video_commands import plan_lines
from hippo.cost import (
    BACKOFF_MAX,
    BACKOFF_START,
    GAMMA_START,
    Acceptance,
    AutoGamma,
    GammaPlan,
    RoundOverhead,
    VerifyCurve,
    _best,
    rates,
    round_seconds,
)
from hippo.errors import ConfigError
from hippo.interfaces import Drafter
from hippo.plugins.auto_scheduler import KEEP_RATIOS, draft_seconds, length_band
from hippo.proposal import DraftProposal
from hippo.registry import lookup
from hippo.testing import models as hm
from hippo.testing import reference as hr
from hippo.testing import strategies as hs
from hippo.testing.drafters import corrupting_plugin
from hippo.testing.prefill import shared_prefill
from hippo.testing.sampling import SWITCHING, LawCheck, generation, sampling_case, target_law
from hippo.types import Stats
from hippo.visual import budget

ADAPTER = "qwen2_5_vl"
NEW = 64
FLIPS = (10, 30)
#: t_decode 1, t_verify(2) 1.1, t_draft 0.2: taking turns, γ = 1 pays while α > 0.18, so it pays at
#: the prior 1/2 and loses once a few rounds have rejected their first token
COSTS = {"verify": {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7, 17: 2.6}, "draft": 0.2}
#: beside a draft thread the draft's time is hidden: drafting loses only on a steep verify curve
STEEP = {"verify": {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.5, 17: 9.0}, "draft": 0.2}
INLINE = {"executor": "inline", "executor_options": {"overlap": "off"}}
THREAD = {"executor": "inline", "executor_options": {"overlap": "thread"}}
FLIPPING = "test-planner-flipping"


class FlippingDrafter(Drafter):
    """The chain drafter whose first token of a round is wrong (greedy only: w = x + 1 mod V) until
    the prefix holds `flips[0]` new tokens, right until `flips[1]`, wrong until `flips[2]`, ..."""

    @attrs.frozen
    class Config:
        flips: tuple[int, ...] = attrs.field(default=FLIPS, converter=tuple)

    def __init__(self, config=None):
        super().__init__(config)
        self.base = lookup("drafters", "chain")()

    def propose(self, session, prefix, gamma, policy, should_stop=None) -> DraftProposal:  # prefix [T]
        prop = self.base.propose(session, prefix, gamma, policy, should_stop)
        new = prefix.shape[0] - session.prompt_length
        if prop.size == 0 or sum(new >= f for f in self.config.flips) % 2:
            return prop
        tokens = prop.tokens.clone()  # [γ]
        tokens[0] = (tokens[0] + 1) % int(session.last_logits.shape[-1])
        return DraftProposal(tokens=tokens)


class _FlippingPlugin:
    @hippo.hookimpl
    def hippo_register_drafters(self):
        return {FLIPPING: FlippingDrafter}


@contextlib.contextmanager
def drafter(kind: str):
    """(drafter name, options, separate draft model?) for "wrong", "right" or "flip"."""
    if kind == "wrong":
        with corrupting_plugin() as name:
            yield name, {"wrong": (True,)}
    elif kind == "right":
        yield "chain", {}
    else:
        pm, plugin = hippo.plugin_manager(), _FlippingPlugin()
        pm.register(plugin, name=FLIPPING)
        try:
            yield FLIPPING, {}
        finally:
            pm.unregister(plugin=plugin)


def modes(out) -> str:
    """After the first token, each target event as "D" (a verification: drafting) or "T" (a step of
    the target alone), runs collapsed: e.g. "DTDT"."""
    kinds = [e.kind for e in out.stats.events if e.lane == "target" and e.kind in ("verify", "step")]
    seq = "".join("D" if k == "verify" else "T" for k in kinds[1:])
    return "".join(c for i, c in enumerate(seq) if i == 0 or c != seq[i - 1])


def run(scheduler: str, kind: str, executor: dict | None = None, costs: dict = COSTS, own_draft=False):
    target = hm.tiny(ADAPTER, "target")
    p = hm.Prompt.default(ADAPTER, target)
    gen = {"do_sample": False, "max_new_tokens": NEW}
    ref = hr.reference(target, p.inputs, **gen)
    with drafter(kind) as (name, options):
        pipe = hr.build_pipeline(
            target,
            hm.tiny(ADAPTER, "draft") if own_draft else target,  # a thread needs a model of its own
            scheduler=scheduler,
            gamma="auto",
            keep_ratio=1.0,
            drafter=name,
            drafter_options=options,
            executor={"costs": costs, **({} if scheduler == "serial" else executor or INLINE)},
        )
        out = pipe.generate(p.inputs, timeline=True, **gen)
    hr.assert_same(out, ref, p.length)
    assert len(hr.new_tokens(ref, p.length)) == NEW, "the reference stopped early: the test needs all NEW"
    return out


@pytest.mark.parametrize("scheduler", ["serial", "pearl", "hippo"])
def test_a_wrong_draft_hands_decoding_to_the_target(scheduler):
    out = run(scheduler, "wrong")
    s = out.stats
    assert s.target_steps >= NEW // 2, s.plan
    assert not any(s.accepted_per_round)
    plan = s.plan["gamma"]
    assert plan["target_steps"] == s.target_steps and plan["probes"] >= 2
    assert plan["gamma"] == 0 and plan["tokens_per_second"]["target alone"] == 1.0
    assert modes(out).startswith("DT")


@pytest.mark.parametrize("scheduler", ["serial", "pearl", "hippo"])
def test_a_right_draft_keeps_drafting(scheduler):
    s = run(scheduler, "right").stats
    assert s.target_steps == 0 and s.plan["gamma"]["target_runs"] == 0
    assert s.acceptance_rate == 1.0 and s.plan["gamma"]["gamma"] >= 1


@pytest.mark.parametrize("scheduler", ["serial", "pearl", "hippo"])
def test_a_flipping_draft_switches_both_ways(scheduler):
    out = run(scheduler, "flip")
    s = out.stats
    assert "DTDT" in modes(out), modes(out)
    assert s.target_steps > 0 and s.plan["gamma"]["probes"] >= 1
    assert any(s.accepted_per_round), "drafting resumed after the target-only steps and was accepted"


def _rounds_before_target_alone(stats) -> int:
    kinds = [e.kind for e in stats.events if e.lane == "target" and e.kind in ("verify", "step")]
    return kinds[1:].index("step")


def test_beside_a_draft_thread_the_costs_overlap():
    """q's time is hidden: on `COSTS` a round of γ = 1 costs max(0.2, 1.1) beside a thread against
    0.2 + 1.1 inline, and 1.0 for the target alone. With every draft wrong, α falls from its prior
    of 1/2 round by round: inline drafting loses below α = 0.3, beside a thread only below 0.1, so
    the thread drafts more rounds before it hands over; on a steep curve drafting loses at once."""
    inline = run("hippo", "wrong", INLINE, COSTS, own_draft=True).stats
    thread = run("hippo", "wrong", THREAD, COSTS, own_draft=True).stats
    assert thread.plan["gamma"]["parallel"] is True and inline.plan["gamma"]["parallel"] is False
    assert inline.target_steps > 0 and thread.target_steps > 0  # α tends to 0: neither drafts on
    assert _rounds_before_target_alone(thread) > _rounds_before_target_alone(inline) >= 1
    steep = run("hippo", "wrong", THREAD, STEEP, own_draft=True).stats
    assert steep.plan["gamma"]["parallel"] is True and steep.target_steps > 0
    assert _rounds_before_target_alone(steep) <= _rounds_before_target_alone(inline)


@settings(max_examples=hs.examples(0.25))
@given(
    scheduler=st.sampled_from(["serial", "pearl", "hippo"]),
    flips=st.lists(st.integers(0, 40), max_size=4).map(sorted),
    new=st.integers(1, 40),
    verify2=st.floats(1.0, 2.0),
    draft=st.floats(0.01, 1.0),
)
def test_any_switching_is_lossless(scheduler, flips, new, verify2, draft):
    """Any costs, any flips, any budget: the target's own output, whatever is chosen."""
    target = hm.tiny(ADAPTER, "target")
    p = hm.Prompt.default(ADAPTER, target)
    gen = {"do_sample": False, "max_new_tokens": new}
    costs = {"verify": {1: 1.0, 2: verify2, 17: verify2 * 4}, "draft": draft}
    with drafter("flip") as (name, _):
        pipe = hr.build_pipeline(
            target,
            hm.tiny(ADAPTER, "draft"),
            scheduler=scheduler,
            gamma="auto",
            keep_ratio=0.5,
            drafter=name,
            drafter_options={"flips": flips},
            executor={"costs": costs, **({} if scheduler == "serial" else INLINE)},
        )
        out = pipe.generate(p.inputs, **gen)
    hr.assert_same(out, hr.reference(target, p.inputs, **gen), p.length)


# ---- the plan itself ------------------------------------------------------------------------------


def _round(stats: Stats, gamma: int, accepted: int) -> None:
    stats.record_round(gamma, accepted, accepted + 1, accepted < gamma)


def test_the_back_off_doubles_and_resets():
    """Wrong drafts: target-only runs of 4, 8, 16, ... steps, each followed by one probe round of
    γ >= GAMMA_START; a probe that is fully accepted brings drafting back and the back-off resets."""
    plan = AutoGamma(parallel=False, costs=COSTS).plan()
    stats = Stats()
    choices = []
    for _ in range(200):
        g = plan.next(stats, None)
        choices.append(g)
        if g:
            _round(stats, g, 0)
    runs, count = [], 0
    for g in choices:
        if g == 0:
            count += 1
        elif count:
            runs.append(count)
            count = 0
    assert runs[:4] == [BACKOFF_START, 2 * BACKOFF_START, 4 * BACKOFF_START, 8 * BACKOFF_START], runs
    assert max(runs) <= BACKOFF_MAX
    probes = [g for prev, g in zip(choices, choices[1:]) if prev == 0 and g]
    assert probes and min(probes) >= GAMMA_START
    # a probe that is all accepted: drafting pays again at once, and a later loss waits BACKOFF_START
    while (g := plan.next(stats, None)) == 0:
        pass
    _round(stats, g, g)
    assert plan.next(stats, None) >= 1
    assert plan.backoff == BACKOFF_START


def _target_alone_runs(choices: list[int]) -> list[int]:
    runs, count = [], 0
    for g in [*choices, 1]:
        if g == 0:
            count += 1
        elif count:
            runs.append(count)
            count = 0
    return runs


def test_a_job_with_a_carried_acceptance_starts_from_the_last_jobs_back_off():
    """A plan started from a carried α (`auto`'s earlier jobs) waits half the back-off the last booked
    plan ended with before its first probe, not BACKOFF_START; a plan of its own α (no prior) starts
    at BACKOFF_START, and a plan whose drafting paid at its end leaves BACKOFF_START behind."""
    auto = AutoGamma(parallel=False, costs=COSTS)
    first, stats = auto.plan(), Stats()
    for _ in range(200):
        if g := first.next(stats, None):
            _round(stats, g, 0)
    first.book(stats)
    assert auto.carried_backoff == first.backoff > 4 * BACKOFF_START
    for prior, start in ((0.01, auto.carried_backoff // 2), (None, BACKOFF_START)):
        plan, stats, choices = auto.plan(prior=prior), Stats(), []
        while len(_target_alone_runs(choices)) < 2:  # wrong drafts: a run, a probe, another run
            choices.append(g := plan.next(stats, None))
            if g:
                _round(stats, g, 0)
        first_run = _target_alone_runs(choices)[0]
        assert first_run == start and choices[choices.index(0) + start] >= GAMMA_START  # then a probe
        assert plan.record()["backoff_start"] == start
    paid, stats = auto.plan(prior=0.9), Stats()
    _round(stats, g := paid.next(stats, None), g)
    paid.book(stats)
    assert auto.carried_backoff == BACKOFF_START


def test_a_batch_drafts_while_its_rows_together_gain():
    """A batch's plan sums its rows' expected tokens, each row's α from its own rounds: a row whose
    drafts are always rejected makes a plan of its own stop drafting, but beside a row whose drafts
    are always accepted the batch drafts on, each round's γ the best of the batch's `rates`."""
    auto = AutoGamma(parallel=False, costs=COSTS)
    alone, stats = auto.plan(), Stats()
    choices = []
    for _ in range(8):
        choices.append(g := alone.next(stats, None))
        if g:
            _round(stats, g, 0)
    assert 0 in choices
    batch, good, bad = auto.plan(), Stats(), Stats()
    for _ in range(12):
        g = batch.next([good, bad], None)
        alphas = batch.last["alpha"]
        per_gamma = rates(auto.curve, alphas, auto.t_draft, False)
        assert g >= 1 and g == _best(per_gamma)
        one = [rates(auto.curve, a, auto.t_draft, False) for a in alphas]
        assert per_gamma == pytest.approx([x + y for x, y in zip(*one)])
        _round(good, g, g)
        _round(bad, g, 0)
    assert alphas[0] > 0.9 and alphas[1] < 0.18  # the bad row alone would not draft


def test_acceptance_counts_only_checked_tokens():
    """α counts the tokens verification checked: one round of γ = 8 rejecting the second token
    checked two tokens (1 accepted), not eight."""
    plan = GammaPlan(AutoGamma(parallel=False, costs=COSTS), parallel=False)
    stats = Stats()
    _round(stats, 8, 1)
    assert plan.acceptance.update(stats) == pytest.approx((1 + 1) / (2 + 2))


@pytest.mark.parametrize(
    "costs",
    [
        {"draft": 0.1},
        {"verify": {}},
        {"verify": {0: 1.0}},
        {"verify": {1: -1.0}},
        {"verify": {1: 1}, "draft": 0},
    ],
)
def test_bad_costs_are_refused_clearly(costs):
    with pytest.raises(ConfigError, match="costs"):
        AutoGamma(parallel=False, costs=costs)
    with pytest.raises(ConfigError, match="costs"):
        lookup("schedulers", "serial").from_options(gamma=5, costs=costs)  # checked even if unused
    with pytest.raises(ConfigError, match="costs"):
        lookup("schedulers", "hippo").from_options(gamma="auto", costs=costs)


def test_fixed_costs_need_no_calibration():
    auto = AutoGamma(parallel=True, costs={"verify": {"1": 2.0}})  # keys as JSON gives them
    assert auto.curve(1) == 2.0 and auto.t_draft is None
    auto.calibrate(None, torch.zeros(1, dtype=torch.long))  # the curve is kept: nothing is measured
    assert auto.curve(3) == pytest.approx(6.0)


# ---- scheduler="auto" -----------------------------------------------------------------------------


@pytest.fixture
def auto_scheduler():
    """`scheduler="auto"` registered (its entry point may not be installed yet); yields its module."""
    from hippo.plugins import auto_scheduler as module

    pm = hippo.plugin_manager()
    registered = "auto" not in hm.names("schedulers")
    if registered:
        pm.register(module, name="test-planner-auto-scheduler")
    try:
        yield module
    finally:
        if registered:
            pm.unregister(name="test-planner-auto-scheduler")


def _auto_pipeline(target, draft, cache_dir):
    return (
        hippo.PipelineBuilder()
        .target(target)
        .draft(draft)
        .selector("uniform", keep_ratio=0.5)
        .scheduler("auto", cache_dir=str(cache_dir))
        .build()
    )


def test_auto_is_lossless_and_says_what_it_chose(auto_scheduler, tmp_path):
    target, draft = hm.tiny(ADAPTER, "target"), hm.tiny(ADAPTER, "draft")
    p = hm.Prompt.default(ADAPTER, target)
    pipe = _auto_pipeline(target, draft, tmp_path)
    for new in (1, 7, 30):
        gen = {"do_sample": False, "max_new_tokens": new}
        out = pipe.generate(p.inputs, **gen)
        hr.assert_same(out, hr.reference(target, p.inputs, **gen), p.length)
        plan = out.stats.plan
        assert plan["schedule"] in ("autoregressive", "serial", "hippo", "pearl") and plan["why"]
        options = plan["tokens_per_second"]
        drafting = [v for k, v in options.items() if k != "autoregressive" and v is not None]
        assert plan["schedule"] == "autoregressive" or options[plan["schedule"]] == max(drafting)
        assert plan["costs"]["t_decode"] > 0 and plan["costs"]["draft_pruned"] > 0
        measured = plan["measured"]  # the outcome beside the prediction
        rate = measured["tokens_per_second"]
        assert rate is None if new == 1 else rate > 0
        assert measured["alpha"] is None if not out.stats.rounds else 0 <= measured["alpha"] <= 1
        assert measured["alpha"] == (out.stats.acceptance_rate if out.stats.rounds else None)
    assert json.loads(json.dumps(out.stats.as_dict()))["plan"]["schedule"] == plan["schedule"]
    lines = plan_lines(plan)  # what `hippo generate -v` prints
    assert lines[0] == f"plan: schedule {plan['schedule']}: {plan['why']}"
    assert "predicted tokens/s: autoregressive " in lines[1]
    assert any(li.startswith("  measured: ") and "tokens/s after the first token" in li for li in lines)
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_auto_costs_are_measured_once_per_machine_and_pair(auto_scheduler, tmp_path, monkeypatch):
    target, draft = hm.tiny(ADAPTER, "target"), hm.tiny(ADAPTER, "draft")
    p = hm.Prompt.default(ADAPTER, target)
    gen = {"do_sample": False, "max_new_tokens": 5}
    ref = hr.reference(target, p.inputs, **gen)
    first = _auto_pipeline(target, draft, tmp_path)
    out = first.generate(p.inputs, **gen)
    hr.assert_same(out, ref, p.length)
    (path,) = tmp_path.glob("*.json")
    cached = json.loads(path.read_text())
    assert cached["key"]["torch"] == torch.__version__
    assert set(cached["costs"]) == {"verify", "draft", "draft_steps", "draft_prefills"}
    # q's step and prefill at each keep ratio (the whole video, the selector's 0.5, then 0.25, 0.1 and
    # 0.05), against the tokens it attends to; then the job's own prefill, live
    steps, prefills = cached["costs"]["draft_steps"], cached["costs"]["draft_prefills"]
    assert len(steps) == len(prefills) == 5 and [n for n, _ in steps] == [n for n, _ in prefills]
    assert all(t > 0 for _, t in steps + prefills)
    ((tokens, seconds),) = first.scheduler.draft_prefills
    assert seconds > 0 and tokens == p.length - out.stats.visual_tokens + out.stats.kept_visual_tokens

    calls = []
    real = auto_scheduler.measure
    monkeypatch.setattr(auto_scheduler, "measure", lambda *a: calls.append(1) or real(*a))
    # a new pipeline on the same machine and pair reads the file
    hr.assert_same(_auto_pipeline(target, draft, tmp_path).generate(p.inputs, **gen), ref, p.length)
    assert calls == []
    # a corrupt file is measured again and rewritten
    path.write_text("{not json")
    hr.assert_same(_auto_pipeline(target, draft, tmp_path).generate(p.inputs, **gen), ref, p.length)
    assert calls == [1] and json.loads(path.read_text())["key"] == cached["key"]
    # a retrained draft (other values, the same shapes) takes as long: it reads the file
    retrained = hm.tiny(ADAPTER, "draft", 1)
    hr.assert_same(_auto_pipeline(target, retrained, tmp_path).generate(p.inputs, **gen), ref, p.length)
    assert calls == [1] and len(list(tmp_path.glob("*.json"))) == 1
    # another draft (other shapes: the target itself) is another key
    hr.assert_same(_auto_pipeline(target, target, tmp_path).generate(p.inputs, **gen), ref, p.length)
    assert calls == [1, 1] and len(list(tmp_path.glob("*.json"))) == 2
    # kernels capped below the CPU's own (as on a machine without AVX-512) are another key
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    hr.assert_same(_auto_pipeline(target, draft, tmp_path).generate(p.inputs, **gen), ref, p.length)
    assert calls == [1, 1, 1] and len(list(tmp_path.glob("*.json"))) == 3


def test_auto_runs_the_target_alone_where_no_draft_could_pay(auto_scheduler, tmp_path):
    """Costs where a draft step costs as much as a target step and verifying 2 tokens twice as much:
    even an always-right draft is slower, so the job is the target alone."""
    target, draft = hm.tiny(ADAPTER, "target"), hm.tiny(ADAPTER, "draft")
    p = hm.Prompt.default(ADAPTER, target)

    def pipe_with(costs):
        b = hippo.PipelineBuilder().target(target).draft(draft).selector("uniform", keep_ratio=0.5)
        return b.scheduler("auto", cache_dir=str(tmp_path), costs=costs).build()

    with pytest.raises(ConfigError, match="draft"):
        pipe_with({"verify": {1: 1.0}})  # fixed costs need the draft's too
    pipe = pipe_with({"verify": {1: 1.0, 2: 2.0, 17: 17.0}, "draft": 1.0})
    gen = {"do_sample": False, "max_new_tokens": 9}
    out = pipe.generate(p.inputs, **gen)
    hr.assert_same(out, hr.reference(target, p.inputs, **gen), p.length)
    assert out.stats.plan["schedule"] == "autoregressive" and out.stats.rounds == 0
    assert not list(tmp_path.glob("*.json"))  # nothing was measured
    # a cheap draft on the same pipeline: drafting is chosen
    out = pipe_with({"verify": {1: 1.0, 2: 1.05, 17: 2.0}, "draft": 0.05}).generate(p.inputs, **gen)
    hr.assert_same(out, hr.reference(target, p.inputs, **gen), p.length)
    assert out.stats.plan["schedule"] != "autoregressive" and out.stats.rounds > 0


def test_auto_takes_pearl_where_the_draft_shares_the_targets_device(auto_scheduler, tmp_path, monkeypatch):
    """pearl and hippo decode alike in the cost model; hippo's early draft prefill is free only where
    the draft has a device of its own, so a tie goes to pearl on one device and to hippo on two."""
    target, draft = hm.tiny(ADAPTER, "target"), hm.tiny(ADAPTER, "draft")
    p = hm.Prompt.default(ADAPTER, target)
    costs = {"verify": {1: 1.0, 2: 1.05, 17: 2.0}, "draft": 0.5}  # drafting beside p pays
    b = hippo.PipelineBuilder().target(target).draft(draft).selector("uniform", keep_ratio=0.5)
    pipe = b.scheduler("auto", cache_dir=str(tmp_path), costs=costs).build()
    monkeypatch.setattr(auto_scheduler, "usable_cores", lambda: 8)  # a draft process is offered
    job = pipe.job(p.inputs, do_sample=False, max_new_tokens=8)
    name, record = pipe.scheduler.choose(job)
    rates = record["tokens_per_second"]
    assert record["draft_overlaps_target"] and rates["pearl"] == rates["hippo"] > rates["serial"]
    assert name == "pearl" and "shares the target's device" in record["why"]
    monkeypatch.setattr(auto_scheduler, "own_device", lambda job: True)
    name, record = pipe.scheduler.choose(job)
    assert name == "hippo" and "its own device" in record["why"]
    pipe.close()


def test_auto_puts_a_parallel_batchs_draft_rows_in_a_draft_process(auto_scheduler, tmp_path, monkeypatch):
    """Where a draft process is offered (4+ CPU cores) and drafting beside the target pays, a batch
    runs `pearl` with its draft rows in the draft process (the schedule's executor's own place for
    them), each row its own `target.generate`."""
    from hippo.plugins import auto_executor

    target, draft = hm.tiny(ADAPTER, "target"), hm.tiny(ADAPTER, "draft")
    p = hm.Prompt.default(ADAPTER, target)
    costs = {"verify": {1: 1.0, 2: 1.05, 17: 2.0}, "draft": 0.5}  # drafting beside p pays
    b = hippo.PipelineBuilder().target(target).draft(draft).selector("uniform", keep_ratio=0.5)
    pipe = b.scheduler("auto", cache_dir=str(tmp_path), costs=costs).build()
    monkeypatch.setattr(auto_scheduler, "usable_cores", lambda: 8)
    monkeypatch.setattr(auto_executor, "usable_cores", lambda: 8)
    gens = [{"do_sample": False, "max_new_tokens": m} for m in (9, 6)]
    prompts = [p, hm.Prompt.default(ADAPTER, target, frames=1)]
    outs = pipe.generate_batch([q.inputs for q in prompts], per_row=gens)
    pipe.close()
    for out, q, gen in zip(outs, prompts, gens):
        hr.assert_same(out, hr.reference(target, q.inputs, **gen), q.length)
        assert out.stats.plan["schedule"] == "pearl" and out.stats.rounds > 0
        assert any("beside the target in its own process" in n for n in out.stats.notes), out.stats.notes


# ---- hippo generate -v / --json -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["right", "wrong"])
def test_auto_starts_a_job_from_the_acceptance_of_the_earlier_ones(auto_scheduler, tmp_path, kind):
    """The γ planner of `auto`'s schedule starts each job from the α its pipeline's earlier jobs saw,
    not from 1/2. Its first round drafts `GAMMA_START` either way (q's step is not timed yet); after
    a draft that was always right, the next job drafts longer from its second round on; after one
    that was always wrong, the next job runs the target alone (`auto`'s no-regret rule) and the one
    after, a probe, hands over to the target alone after fewer rounds. All stay exact."""
    target = hm.tiny(ADAPTER, "target")
    p = hm.Prompt.default(ADAPTER, target)
    gen = {"do_sample": False, "max_new_tokens": 24}
    ref = hr.reference(target, p.inputs, **gen)
    with drafter(kind) as (name, options):
        b = hippo.PipelineBuilder().target(target).draft(target).selector("uniform", keep_ratio=1.0)
        b = b.drafter(name, **options).scheduler("auto", cache_dir=str(tmp_path), costs=COSTS)
        pipe = b.build()
        first, second = (pipe.generate(p.inputs, timeline=True, **gen) for _ in range(2))
        if kind == "wrong":  # drafting now loses at the α seen: one job alone, then a probe
            alone = second
            second = pipe.generate(p.inputs, timeline=True, **gen)
            hr.assert_same(alone, ref, p.length)
            assert alone.stats.plan["schedule"] == "autoregressive" and not alone.stats.rounds
    for out in (first, second):
        hr.assert_same(out, ref, p.length)
        assert out.stats.plan["schedule"] != "autoregressive"  # γ = 0 is the plan's own choice
    assert first.stats.drafted_per_round[0] == second.stats.drafted_per_round[0] == GAMMA_START
    if kind == "right":
        assert second.stats.plan["alpha"] > 0.9 and not second.stats.target_steps
        assert second.stats.drafted_per_round[1] > first.stats.drafted_per_round[1]
    else:
        assert second.stats.plan["alpha"] < 0.2
        assert 1 <= _rounds_before_target_alone(second.stats) < _rounds_before_target_alone(first.stats)


def test_auto_runs_the_target_alone_after_a_draft_that_loses_and_probes_it_again(auto_scheduler, tmp_path):
    """No regret on a draft that cannot help: where drafting is predicted slower than the target
    alone at the α of earlier jobs, `auto` runs the next jobs with the target alone, the draft not
    even prefilled, and probes the draft again after 1 such job, then 2, then 4 (`JOB_BACKOFF_MAX`
    caps the wait); a draft that pays again resets it. Every answer stays exact."""
    target = hm.tiny(ADAPTER, "target")
    p = hm.Prompt.default(ADAPTER, target)
    gen = {"do_sample": False, "max_new_tokens": 12}
    ref = hr.reference(target, p.inputs, **gen)
    with drafter("wrong") as (name, options):
        b = hippo.PipelineBuilder().target(target).draft(target).selector("uniform", keep_ratio=1.0)
        b = b.drafter(name, **options).scheduler("auto", cache_dir=str(tmp_path), costs=SWITCHY)
        pipe = b.build()
        outs = [pipe.generate(p.inputs, **gen) for _ in range(9)]
    schedules = [out.stats.plan["schedule"] for out in outs]
    drafted = ["autoregressive" if s == "autoregressive" else "draft" for s in schedules]
    # the prior α drafts; then 1 job alone, a probe, 2 alone, a probe, 4 alone (the last is cut off)
    assert drafted == [
        "draft",
        "autoregressive",
        "draft",
        *["autoregressive"] * 2,
        "draft",
        *["autoregressive"] * 3,
    ]
    for out, s in zip(outs, drafted):
        hr.assert_same(out, ref, p.length)
        if s == "autoregressive":
            assert out.stats.rounds == 0 and out.stats.kept_visual_tokens == 0  # no draft prefill
            assert "without the draft's prefill" in out.stats.plan["why"]
    assert "a probe" in outs[2].stats.plan["why"]
    # a draft that pays again resets the wait
    sched = pipe.scheduler
    sched.acceptance = type(sched.acceptance).starting_at(0.95)
    sched.by_keep.clear()  # the keep-ratio planner's α too
    job = pipe.job(p.inputs, **gen)
    name, record = sched.choose(job)
    assert sched._no_regret(name, record) != "autoregressive" and (sched.skip, sched.job_backoff) == (0, 1)
    pipe.close()


def test_generate_verbose_and_json_say_what_was_chosen(tmp_path, capsys):
    pytest.importorskip("av")
    from tiny_checkpoint import save_checkpoint, write_video

    from hippo.cli.main import main

    target, draft = (
        save_checkpoint(tmp_path / "target"),
        save_checkpoint(tmp_path / "draft", role="draft", seed=1),
    )
    video = write_video(tmp_path / "v.mp4", n=8, fps=8, size=(64, 64))
    args = ["generate", "--target", str(target), "--draft", str(draft), "--video", str(video)]
    args += [
        "--prompt",
        "describe the video .",
        "--frames",
        "4",
        "--max-pixels",
        "3136",
        "--max-new-tokens",
        "12",
    ]
    args += ["--scheduler", "serial", "--gamma", "auto", "--keep-ratio", "0.25", "--no-progress"]
    assert main([*args, "-v", "--json", str(tmp_path / "out.json")]) == 0
    err = capsys.readouterr().err
    assert "plan: γ per round: " in err and "predicted tokens/s: target alone " in err, err
    plan = json.loads((tmp_path / "out.json").read_text())["stats"]["plan"]["gamma"]
    assert plan["target_steps"] >= 0 and set(plan["tokens_per_second"]) >= {"target alone"}
    assert main(args) == 0
    assert "plan:" not in capsys.readouterr().err  # without -v nothing more is said


# ---- sampling -------------------------------------------------------------------------------------

#: γ = 1 pays at the prior α = 1/2 (1.5 / 1.4 tokens per unit) and loses after one rejection (4/3 / 1.4)
SWITCHY = {"verify": {1: 1.0, 2: 1.1, 17: 2.6}, "draft": 0.3}


@pytest.mark.parametrize(
    "scheduler",
    # serial's and hippo's γ from the cost model are paths of the planted-bug matrix, each checked at
    # full power in test_sampling.py, as every path is once; these second law checks of theirs run
    # with the matrix (`pytest -m matrix`), and test_any_switching_is_lossless switches under greedy
    [pytest.param("serial", marks=pytest.mark.matrix), pytest.param("hippo", marks=pytest.mark.matrix)],
)
def test_switching_samples_the_target_law(scheduler):
    """Sampling with rounds and target-only steps mixed within each run: the target's exact law,
    checked with the law test's power (`LawCheck`: power >= 0.95 against a TV error of 0.05 at level
    2.5e-5, on a peaked law). Every drafting's first token is corrupted, so none is accepted in part (no
    vacuity guard); at least a quarter of the runs must mix rounds and target-only steps instead."""
    case = sampling_case(ADAPTER, gamma="auto", keep_ratio=0.25, corrupt=(True,))
    check = LawCheck.plan(target_law(case, **SWITCHING))  # `python -m hippo.testing.sampling` lists it
    gen = generation(SWITCHING["temperature"], SWITCHING["top_k"], None, None, case.max_new_tokens)
    mixed = 0
    with corrupting_plugin():
        pipe = case.builder(scheduler, costs=SWITCHY).build()  # hippo: the inline executor
        try:
            # one prefill for all runs, their forwards replayed by history (hippo.testing.prefill)
            with shared_prefill(pipe, replay=True):
                for run in range(check.runs):
                    out = pipe.generate(case.inputs, seed=run, **gen)
                    failure = check.add(hr.new_tokens(out.sequences, case.prompt.length), out.stats)
                    assert failure is None, f"{failure}; {check.details()}"
                    mixed += out.stats.target_steps > 0 and out.stats.rounds > 0
        finally:
            pipe.close()
    res = check.result
    print(res.summary())
    assert res.power >= 0.95 and res.runs == check.runs == res.looks[-1], res.summary()
    assert mixed >= check.runs // 4, f"{mixed} of {check.runs} runs mixed rounds and target-only steps"


class _Clock:
    """A target session's timing counters, advanced by hand."""

    def __init__(self) -> None:
        self.seconds_decode, self.forwards, self.tokens_forwarded = 0.0, 0, 0

    def step(self, seconds: float, k: int = 1) -> None:
        self.seconds_decode += seconds
        self.forwards += 1
        self.tokens_forwarded += k


@pytest.mark.parametrize(("step_seconds", "drafts_again"), [(1.0, False), (10.0, True)])
def test_live_target_steps_rescale_the_calibrated_curve(step_seconds, drafts_again):
    """p's curve was calibrated at t_decode = 1; q's t_draft = 0.2 is live. When p's target-only
    steps now take 10 (the machine got busier), drafting is worth 10x more than the stale curve
    says, and the plan drafts again after its probe although α has not changed."""
    plan = AutoGamma(parallel=False, costs={"verify": COSTS["verify"]}).plan()
    stats, target = Stats(), _Clock()
    while (g := plan.next(stats, 0.2, target)) != 0:
        _round(stats, g, 0)
        target.step(1.0)
    while g == 0:  # target-only steps, timed, until the probe
        target.step(step_seconds)
        g = plan.next(stats, 0.2, target)
    assert plan.scale == pytest.approx(step_seconds)
    assert plan.record()["t_decode"] == pytest.approx(step_seconds)
    _round(stats, g, 0)  # the probe is rejected too
    target.step(step_seconds)
    assert (plan.next(stats, 0.2, target) > 0) is drafts_again


def test_live_verifications_rescale_the_calibrated_curve():
    """p's curve was calibrated on a short context; on a long one each verification of γ + 1 tokens
    takes 3x the curve's t_verify(γ + 1). Without a single target-only step, the plan's scale follows
    (3), and with p's time tripled against q's live t_draft it drafts longer than the stale curve
    would have it at the same acceptance (3 of each drafting accepted)."""
    curve = {1: 1.0, 2: 1.05, 4: 1.2, 8: 1.5, 17: 2.6}
    plan = AutoGamma(parallel=False, costs={"verify": curve}).plan(prior=0.8)
    stats, target = Stats(), _Clock()
    g = plan.next(stats, 0.3, target)
    first = g
    for _ in range(8):  # 3 drafts accepted a round; each verification 3x the calibration
        _round(stats, g, min(g, 3))
        target.step(3.0 * plan.auto.curve(g + 1), k=g + 1)
        g = plan.next(stats, 0.3, target)
    assert plan.target_steps == 0 and plan.scale == pytest.approx(3.0)
    stale = AutoGamma(parallel=False, costs={"verify": curve}).plan(prior=0.8)
    stale_stats = Stats()
    for _ in range(9):  # the same rounds, untimed: the calibrated curve as it was
        gs = stale.next(stale_stats, 0.3)
        _round(stale_stats, gs, min(gs, 3))
    assert g > stale.next(stale_stats, 0.3) and first >= 1


def test_the_model_digest_follows_what_the_costs_depend_on(auto_scheduler):
    """The cached costs are timings: retrained weights, or the checkpoint loaded from another
    directory, keep them (the digest reads no values, so a cold process does not pass over every
    weight); another shape or dtype does not."""
    model = copy.deepcopy(hm.tiny(ADAPTER, "draft"))  # the tiny models are shared: change a copy
    before = auto_scheduler.model_digest(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    model.config._name_or_path = "/checkpoints/moved/elsewhere"
    assert auto_scheduler.model_digest(model) == before
    assert auto_scheduler.model_digest(copy.deepcopy(model).to(torch.float32)) != before
    wider = copy.deepcopy(model.config)
    wider.text_config.intermediate_size += 8
    assert auto_scheduler.model_digest(type(model)(wider)) != before


def test_a_shrinking_batch_interpolates_its_verify_curve():
    """t_verify(B, k) is measured for a batch size not bracketed by known ones (one row's curve is
    B = 1) and interpolated linearly in B between two that are, so a batch whose rows finish one by
    one measures nothing more."""
    auto = AutoGamma(parallel=False, costs={"verify": {1: 1.0, 17: 3.0}})  # B = 1; t_draft measured
    measured = []

    def measure(widths):
        measured.append(widths)
        return VerifyCurve({k: 9.0 + k for k in widths})  # B = 8

    eight = auto.batch_curve(8, measure)
    assert len(measured) == 1 and eight(1) == 10.0
    four = auto.batch_curve(4, measure)
    assert len(measured) == 1 and 4 not in auto.batch_curves
    for k in auto.widths:
        assert four(k) == pytest.approx(auto.curve(k) + 3 / 7 * (eight(k) - auto.curve(k)))
    auto.batch_curve(9, measure)  # above every size known: measured
    assert len(measured) == 2 and set(auto.batch_curves) == {8, 9}


def _planning(target, draft, cache_dir, steps, **options):
    """`auto` on fixed costs under which drafting pays, with q's step against the tokens it reads."""
    b = hippo.PipelineBuilder().target(target).draft(draft).selector("uniform", keep_ratio=0.5)
    costs = {"verify": {1: 1e-3, 17: 1e-3}, "draft": 1e-4}
    options = {"keep_ratios": KEEP_RATIOS, **options}
    return b.scheduler("auto", cache_dir=str(cache_dir), costs=costs, draft_steps=steps, **options).build()


def _planned(pipe, p, gen: dict, jobs: int):
    """Run `jobs` jobs of `p` on `pipe`, each checked against `target.generate`; yield each output and
    its keep-ratio record."""
    ref = hr.reference(pipe.target_adapter.model, p.inputs, **gen)
    for _ in range(jobs):
        out = pipe.generate(p.inputs, **gen)
        hr.assert_same(out, ref, p.length)
        yield out, out.stats.plan["keep"]


def _kept(out, ratio: float) -> int:
    n = out.stats.visual_tokens
    return n if ratio >= 1.0 else budget(n, ratio)


def test_auto_plans_the_keep_ratio_job_by_job(auto_scheduler, tmp_path):
    """q's step grows with the tokens it attends to, so pruning pays: the first job keeps the
    selector's own ratio, later ones try smaller ratios at the α seen at larger ones. Every answer is
    the target's (float64), and each job's draft kept the chosen share of the video."""
    target = hm.tiny(ADAPTER, "target")
    unit, words = hm.pixel_unit(target), hm.text_ids(target)
    p = hm.Prompt(ADAPTER, target, (4, 6 * unit, 6 * unit), 0, words[3:6], words[7:9])  # 72 visual tokens
    pipe = _planning(target, target, tmp_path, ((0, 1e-5), (100, 1e-3)))
    ratios = []
    for out, keep in _planned(pipe, p, {"do_sample": False, "max_new_tokens": 12}, 4):
        ratios.append(keep["ratio"])
        assert out.stats.kept_visual_tokens == _kept(out, keep["ratio"])
        assert keep["options"][str(keep["ratio"])]["tokens_per_second"] == keep["tokens_per_second"]
        assert any(line.startswith("plan: the draft keeps") for line in plan_lines(out.stats.plan))
    assert ratios[0] == 0.5 and min(ratios[1:]) < 0.5, ratios
    assert not list(tmp_path.glob("*.json"))  # fixed costs: nothing measured


def test_auto_prunes_nothing_where_the_drafts_step_does_not_depend_on_the_tokens(auto_scheduler, tmp_path):
    """A flat step (short videos, where q's step is per-operation overhead): the draft sees the whole
    video, job after job."""
    target, draft = hm.tiny(ADAPTER, "target"), hm.tiny(ADAPTER, "draft")
    p = hm.Prompt.default(ADAPTER, target)
    pipe = _planning(target, draft, tmp_path, ((0, 1e-4), (1000, 1e-4)))
    for out, keep in _planned(pipe, p, {"do_sample": False, "max_new_tokens": 6}, 3):
        assert keep["ratio"] == 1.0
        assert out.stats.kept_visual_tokens == out.stats.visual_tokens


def test_auto_prunes_where_the_drafts_prefill_pays_for_it_over_the_expected_answer(auto_scheduler, tmp_path):
    """A flat step but a prefill that grows with the tokens kept (long videos, where the draft's prefill
    is what pruning saves): the first job keeps the selector's own ratio over the whole video, later
    ones smaller ratios; each option is timed as its prefill plus the expected answer (the last one's
    length) at its predicted tokens/s. (The target drafts for itself: a draft that pays.)"""
    target, draft = hm.tiny(ADAPTER, "target"), hm.tiny(ADAPTER, "draft")
    p = _long_prompt(target)
    flat = ((0, 1e-4), (1000, 1e-4))
    pipe = _planning(target, target, tmp_path, flat, draft_prefills=((0, 0.0), (100, 0.005)))
    ratios = []
    for i, (out, keep) in enumerate(_planned(pipe, p, {"do_sample": False, "max_new_tokens": 6}, 3)):
        assert out.stats.plan["schedule"] == "serial"
        ratios.append(keep["ratio"])
        assert keep["answer_tokens"] == (6 if i == 0 else out.stats.new_tokens)
        for o in keep["options"].values():
            assert o["t_prefill"] > 0
            assert o["answer_seconds"] == pytest.approx(
                o["t_prefill"] + keep["answer_tokens"] / o["tokens_per_second"]
            )
    assert ratios[0] == 0.5 and min(ratios[1:]) < 0.5, ratios
    with pytest.raises(ConfigError, match="draft_prefills"):
        _planning(target, draft, tmp_path, flat, draft_prefills=((1, -1.0),))


def _long_prompt(target) -> hm.Prompt:
    """Eight frames of 6 x 6 patches: 144 visual tokens, where pruning changes q's prefill."""
    unit, words = hm.pixel_unit(target), hm.text_ids(target)
    return hm.Prompt(ADAPTER, target, (8, 6 * unit, 6 * unit), 0, words[3:6], words[7:9])


def test_auto_runs_the_target_alone_where_the_drafts_prefill_cannot_pay_over_the_expected_answer(
    auto_scheduler, tmp_path
):
    """A long video and short answers: even a draft that is always right (the target drafting for
    itself) cannot pay back its prefill over the expected answer, so `auto` runs the target alone
    from the first job, the draft never prefilled nor probed. A longer answer raises the expected
    length until the prefill pays, and the next job drafts. Every answer is exact."""
    target = hm.tiny(ADAPTER, "target")
    p = _long_prompt(target)
    flat = ((0, 1e-4), (1000, 1e-4))
    pipe = _planning(target, target, tmp_path, flat, draft_prefills=((0, 0.0), (100, 0.01)))
    short, long = {"do_sample": False, "max_new_tokens": 4}, {"do_sample": False, "max_new_tokens": 64}
    outs = [out for out, _ in _planned(pipe, p, short, 5)]
    for out in outs:
        plan = out.stats.plan
        assert plan["schedule"] == "autoregressive" and out.stats.kept_visual_tokens == 0, plan["why"]
        assert "always right" in plan["why"] and "its prefill included" in plan["why"]
        seconds = plan["answer_seconds"]
        assert min(seconds[n] for n in seconds if n != "autoregressive") > seconds["autoregressive"]
    assert pipe.scheduler.skip == 0 and not pipe.scheduler.probe_due  # nothing to probe: it cannot pay
    (out, keep), *after = _planned(pipe, p, long, 3)
    assert keep["answer_tokens"] == 4 and out.stats.plan["schedule"] == "autoregressive"  # 4 expected
    assert out.stats.new_tokens == 64
    last = after[-1][0].stats
    assert (
        after[-1][1]["answer_tokens"] > 4
        and last.plan["schedule"] == "serial"
        and last.kept_visual_tokens > 0
    )
    assert last.plan["answer_seconds"]["serial"] < last.plan["answer_seconds"]["autoregressive"]


def test_auto_runs_a_batch_of_short_answers_about_a_long_video_with_the_target_alone(
    auto_scheduler, tmp_path
):
    """A batch's rows are timed as a job alone: over the expected answer, q's prefill on the tokens
    the selector keeps included. Short answers about a long video: the batch runs the target alone,
    no row's draft prefilled; long ones: it drafts. Every row is its own `target.generate`."""
    target = hm.tiny(ADAPTER, "target")
    p = _long_prompt(target)
    flat = ((0, 1e-4), (1000, 1e-4))
    pipe = _planning(target, target, tmp_path, flat, draft_prefills=((0, 0.0), (100, 0.05)))
    for tokens, drafts in ((4, False), (64, True)):
        gen = {"do_sample": False, "max_new_tokens": tokens}
        pipe.scheduler.answers.clear()  # the expected answer: max_new_tokens
        outs = pipe.generate_batch([p.inputs, p.inputs], **gen)
        ref = hr.reference(target, p.inputs, **gen)
        for out in outs:
            hr.assert_same(out, ref, p.length)
            plan = out.stats.plan
            assert plan["batch"] == 2 and plan["answer_seconds"]["autoregressive"] == pytest.approx(
                tokens * 1e-3
            )
            assert (plan["schedule"] != "autoregressive") == drafts and (
                out.stats.kept_visual_tokens > 0
            ) == drafts


def test_auto_keeps_the_alpha_of_each_keep_ratio_per_video_length(auto_scheduler, tmp_path):
    """What a draft loses to pruning depends on the video's length: α seen at a ratio on short videos
    does not decide a video 4x longer, whose first job plans afresh from the selector's own ratio."""
    target, draft = hm.tiny(ADAPTER, "target"), hm.tiny(ADAPTER, "draft")
    unit, words = hm.pixel_unit(target), hm.text_ids(target)
    short = hm.Prompt(ADAPTER, target, (2, 6 * unit, 6 * unit), 0, words[3:6], words[7:9])  # 36 visual tokens
    long = hm.Prompt(ADAPTER, target, (8, 6 * unit, 6 * unit), 0, words[3:6], words[7:9])  # 144
    pipe = _planning(target, draft, tmp_path, ((0, 1e-5), (100, 1e-3)))
    n_short, n_long = (pipe.target_adapter.encode(q.inputs).visual.n for q in (short, long))
    assert length_band(n_short) != length_band(n_long)
    band = length_band(n_short)
    pipe.scheduler.by_keep.update({(band, r): Acceptance.starting_at(0.95) for r in KEEP_RATIOS})
    gen = {"do_sample": False, "max_new_tokens": 6}
    first = pipe.generate(short.inputs, **gen).stats.plan["keep"]
    assert first["band"] == band and first["ratio"] == 0.05  # every ratio seen good on short videos
    out = pipe.generate(long.inputs, **gen)
    hr.assert_same(out, hr.reference(target, long.inputs, **gen), long.length)
    keep = out.stats.plan["keep"]
    assert keep["band"] == length_band(n_long) and set(keep["options"]) == {"1.0", "0.5"}
    assert keep["ratio"] == 0.5


def test_auto_keeps_more_where_pruning_loses_acceptance(auto_scheduler, tmp_path):
    """Where the draft was seen to fail at the smaller ratios, the planner keeps a larger one; with
    `keep_ratios=()` it keeps the selector's own; a bad ratio is refused clearly."""
    target, draft = hm.tiny(ADAPTER, "target"), hm.tiny(ADAPTER, "draft")
    p = hm.Prompt.default(ADAPTER, target)
    steps = ((0, 1e-5), (100, 1e-3))
    pipe = _planning(target, draft, tmp_path, steps)
    band = length_band(pipe.target_adapter.encode(p.inputs).visual.n)
    pipe.scheduler.by_keep.update({(band, r): Acceptance.starting_at(0.05) for r in (0.25, 0.1, 0.05)})
    pipe.scheduler.by_keep[band, 0.5] = Acceptance.starting_at(0.95)
    gen = {"do_sample": False, "max_new_tokens": 6}
    out = pipe.generate(p.inputs, **gen)
    hr.assert_same(out, hr.reference(target, p.inputs, **gen), p.length)
    assert out.stats.plan["keep"]["ratio"] >= 0.5
    b = hippo.PipelineBuilder().target(target).draft(draft).selector("uniform", keep_ratio=0.5)
    default = b.scheduler("auto", cache_dir=str(tmp_path), costs={"verify": {1: 1e-3}, "draft": 1e-4}).build()
    assert "keep" in default.generate(p.inputs, **gen).stats.plan  # the planner is on by default
    own = _planning(target, draft, tmp_path, steps, keep_ratios=()).generate(p.inputs, **gen)
    assert "keep" not in own.stats.plan and own.stats.kept_visual_tokens == budget(
        own.stats.visual_tokens, 0.5
    )
    with pytest.raises(ConfigError, match="keep ratios"):
        _planning(target, draft, tmp_path, steps, keep_ratios=(0.0,))
    with pytest.raises(ConfigError, match="draft_steps"):
        _planning(target, draft, tmp_path, ((1, -1.0),))


def test_the_drafts_step_is_a_line_through_its_measured_steps():
    steps = [(100, 1e-3), (1100, 2e-3), (600, 1.5e-3)]
    assert draft_seconds(steps, 2100) == pytest.approx(3e-3)
    assert draft_seconds([(100, 1e-3), (1100, 0.5e-3)], 5000) == pytest.approx(0.75e-3)  # slope >= 0
    assert draft_seconds([(100, 1e-3)], 9000) == pytest.approx(1e-3)


def test_each_width_p_fed_lately_is_rescaled_by_its_own_live_forwards():
    """A calibration times a few widths and interpolates the rest, but a CPU's kernels do not cost
    linearly in the tokens fed. Live forwards of 6 tokens run at 0.9x the curve and of 8 at 1.2x:
    those widths follow their own ratios, and a width not fed lately the pooled median."""
    curve = {1: 1.0, 2: 1.05, 4: 1.2, 8: 1.5, 17: 2.6}
    plan = AutoGamma(parallel=False, costs={"verify": curve}).plan(prior=0.8)
    stats, target, auto = Stats(), _Clock(), plan.auto
    for k, ratio in [(6, 0.9), (8, 1.2), (6, 0.9), (8, 1.2), (8, 1.2)]:
        plan.next(stats, 0.1, target)
        _round(stats, k - 1, 2)
        target.step(ratio * auto.curve(k), k=k)
    plan.next(stats, 0.1, target)
    live = plan.live_curve(auto.curve)
    assert live(6) == pytest.approx(0.9 * auto.curve(6)) and live(8) == pytest.approx(1.2 * auto.curve(8))
    assert plan.scale == pytest.approx(1.2) and live(4) == pytest.approx(1.2 * auto.curve(4))


@pytest.mark.parametrize(("a", "b", "drafts"), [(0.0, 0.25, "shorter"), (1.0, 0.0, "longer")])
def test_a_rounds_overhead_beyond_the_model_is_fitted_per_width_and_charged(a, b, drafts):
    """The engine reports each round's wall seconds (`GammaPlan.ran`). Here every round costs a + b·k
    (k = γ + 1 tokens verified) beyond γ·t_draft + t_verify(γ + 1). The plan fits it and, at the same
    acceptance, drafts shorter than a plan told nothing where the overhead grows with each token
    verified, and longer where it is the same every round (fewer rounds pay it)."""
    curve = VerifyCurve({1: 1.0, 2: 1.05, 4: 1.2, 8: 1.5, 17: 2.6})
    chosen = {}
    for told in (False, True):
        plan = AutoGamma(parallel=False, costs={"verify": curve.seconds}).plan(prior=0.8)
        stats, target = Stats(), _Clock()
        g = plan.next(stats, 0.1, target)
        for _ in range(10):  # 3 drafts accepted a round, p's forwards as calibrated
            _round(stats, g, min(g, 3))
            target.step(curve(g + 1), k=g + 1)
            if told:
                plan.ran(round_seconds(curve, 0.1, g, False) + a + b * (g + 1), g)
            g = plan.next(stats, 0.1, target)
        chosen[told] = g
        if told:
            overhead = plan.overhead.fit()
            assert overhead(3) == pytest.approx(a + 3 * b) and overhead(9) == pytest.approx(a + 9 * b)
            assert plan.record()["round_overhead"] == pytest.approx(a + b * (g + 1))
    assert chosen[True] >= 1 and (
        chosen[True] < chosen[False] if drafts == "shorter" else chosen[True] > chosen[False]
    )


def test_round_overhead_fits_a_line_through_each_widths_median():
    """Nothing before two widths were seen; then a + b·k through the widths' medians, neither
    negative; an outlier round (a compaction, a collection) moves a median little."""
    fit = RoundOverhead()
    assert fit.fit() is None
    for extra in (0.002, 0.003, 0.050):
        fit.add(6, extra)
    assert fit.fit() is None
    for extra in (0.004, 0.004):
        fit.add(8, extra)
    f = fit.fit()
    assert f(6) == pytest.approx(0.003) and f(8) == pytest.approx(0.004) and f(10) == pytest.approx(0.005)
    falling = RoundOverhead()
    falling.add(2, 0.004)
    falling.add(8, 0.001)
    assert falling.fit()(1) == pytest.approx(0.0025) and falling.fit()(16) == pytest.approx(0.0025)


@pytest.mark.parametrize("rows", [1, 2])
def test_the_engine_tells_the_plan_each_rounds_seconds(monkeypatch, rows):
    """`Engine.step` times each round from its γ's choice to its end and tells the plan
    (`GammaPlan.ran`) with the γ chosen: once a round, for a job alone and for a batch; the plan
    charges what its model missed from the second width seen on. The output stays exact."""
    told = []
    ran = GammaPlan.ran
    monkeypatch.setattr(
        GammaPlan, "ran", lambda self, s, g: (told.append((s, g, self.last.get("gamma"))), ran(self, s, g))
    )
    target, draft = hm.tiny(ADAPTER, "target"), hm.tiny(ADAPTER, "draft")
    p = hm.Prompt.default(ADAPTER, target)
    pipe = hippo.PipelineBuilder().target(target).draft(draft).scheduler("serial", gamma="auto").build()
    gen = {"do_sample": False, "max_new_tokens": 24}
    outs = pipe.generate_batch([p.inputs] * rows, **gen) if rows > 1 else [pipe.generate(p.inputs, **gen)]
    pipe.close()
    for out in outs:
        hr.assert_same(out, hr.reference(target, p.inputs, **gen), p.length)
    stats = outs[0].stats
    assert len(told) == stats.rounds + stats.target_steps, (len(told), stats.rounds, stats.target_steps)
    assert all(s > 0 for s, _, _ in told) and all(g == chosen for _, g, chosen in told[1:])
