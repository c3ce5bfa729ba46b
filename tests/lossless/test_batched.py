"""Batched decoding is lossless: every row of a batch equals that row's own `target.generate`.

Batches of 1-4 rows with different videos, prompt lengths, token budgets and EOS positions; drafts by
the tiny draft or the target itself on pruned visual tokens, with corrupted positions, so rows reject
at different rounds. Float64 tiny models on CPU, so equality is exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hippo
import hippo.stacked as hst
from hippo.engine import Engine
from hippo.errors import UnsupportedError
from hippo.padded import pad_rows
from hippo.testing import batch as batch_check
from hippo.testing import models as hm
from hippo.testing import params as hp
from hippo.testing import reference as hr
from hippo.testing import strategies as hs
from hippo.testing.drafters import registered
from hippo.testing.sampling import BATCHED, config_check

ADAPTERS = hp.adapter_params()


def fixed_prompts(adapter: str, target) -> list[hm.Prompt]:
    """Three prompts of different videos and lengths."""
    unit, words = hm.pixel_unit(target), hm.text_ids(target)
    return [
        hm.Prompt(adapter, target, (2, 2 * unit, 2 * unit), 0, words[3:6], words[7:9]),
        hm.Prompt(adapter, target, (1, unit, 2 * unit), 1, words[3:4], words[7:12]),
        hm.Prompt(adapter, target, (3, 2 * unit, unit), 2, [], words[1:3]),
    ]


class Seen:
    """What the rows of the checked batches did, for the vacuity check."""

    def __init__(self):
        self.partial = self.full = self.ragged = 0

    def add(self, outs) -> None:
        self.partial += sum(len(hr.partial_rounds(o)) for o in outs)
        self.full += sum(
            a == g > 0 for o in outs for a, g in zip(o.stats.accepted_per_round, o.stats.drafted_per_round)
        )
        rounds = [o.stats.accepted_per_round for o in outs]
        self.ragged += any(
            len({r[i] for r in rounds if i < len(r)}) > 1 for i in range(max(map(len, rounds)))
        )

    def check(self) -> None:
        assert self.partial and self.full and self.ragged, (
            f"vacuous: {self.partial} partial rounds, {self.full} fully accepted rounds, "
            f"{self.ragged} batches whose rows accepted different numbers of tokens in the same round"
        )


def draw_rows(data, adapter: str, target, least: int) -> tuple[list[hm.Prompt], list[dict]]:
    """`least`-4 rows: prompts of different videos and lengths, each with its own greedy settings
    (token budget, EOS position, and maybe a repetition penalty: a processed row drafts on the host
    while the plain rows beside it keep their draft tokens on the device in the same round)."""
    n = data.draw(st.integers(least, 4), label="rows")
    prompts = [data.draw(hs.prompts(adapter, target), label=f"prompt {i}") for i in range(n)]
    gens = []
    for i, p in enumerate(prompts):
        gen = {"do_sample": False, "max_new_tokens": data.draw(hs.max_new_tokens, label=f"max_new {i}")}
        if data.draw(st.booleans(), label=f"repetition penalty {i}"):
            gen["repetition_penalty"] = 1.3
        gens.append(hr.eos_stop(target, p.inputs, gen, data.draw(hs.eos_picks, label=f"EOS pick {i}"))[0])
    return prompts, gens


def check_batch(pipe, prompts, gens, eager: bool = False, padding: str | None = None):
    """Decode `prompts` as one batch (a list, or with `padding` "left"/"right" one padded processor batch
    where the rows' media can be concatenated); every row must be its own `target.generate`."""
    refs = [hr.reference(pipe.target, p.inputs, **g) for p, g in zip(prompts, gens)]
    saved = hst.COMPACT_MIN, hst.COMPACT_SHARE
    if eager:  # compact at every hole
        hst.COMPACT_MIN, hst.COMPACT_SHARE = 1, 0.0
    try:
        rows = [p.inputs for p in prompts]
        batch = None if padding is None else pad_rows(rows, padding)
        outs = pipe.generate_batch(rows if batch is None else batch, per_row=gens)
    finally:
        hst.COMPACT_MIN, hst.COMPACT_SHARE = saved
    assert len(outs) == len(prompts)
    for out, ref, p in zip(outs, refs, prompts):
        hr.assert_same(out, ref, p.length)
        s = out.stats
        assert s.new_tokens == ref.shape[1] - p.length
        assert all(0 <= a <= g for a, g in zip(s.accepted_per_round, s.drafted_per_round))
    return outs


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_batch_rows_equal_their_own_generate(adapter, corrupting_drafter):
    """Serial (fixed γ) and the target alone, batched: each row is its own `target.generate`, token for
    token. Two fixed batches first (a self-draft on every visual token, its third draft token
    corrupted: partial and, near a row's budget, full rounds; a pruned self-draft: rows accepting
    different numbers of tokens in one round); the check fails unless those happened."""
    target = hm.tiny(adapter, "target")
    seen = Seen()
    prompts = fixed_prompts(adapter, target)
    for keep, wrong, budgets in ((1.0, (0, 0, 1), (16, 3, 20)), (0.5, (), (16, 5, 20))):
        fixed = hr.build_pipeline(
            target,
            target,
            gamma=4,
            keep_ratio=keep,
            drafter=corrupting_drafter,
            drafter_options={"wrong": wrong},
        )
        gens = [{"do_sample": False, "max_new_tokens": m} for m in budgets]
        seen.add(check_batch(fixed, prompts, gens, eager=keep < 1))

    @settings(max_examples=hs.examples(0.6))
    @given(data=st.data())
    def check(data):
        prompts, gens = draw_rows(data, adapter, target, 1)
        scheduler = data.draw(st.sampled_from(["serial", "serial", "autoregressive"]), label="scheduler")
        role = data.draw(st.sampled_from(["self", "self", "draft"]), label="draft")
        draft = target if role == "self" else hm.tiny(adapter, "draft")
        wrong = data.draw(st.none() | hs.corrupt_patterns, label="corrupted positions")
        selector, scorer = data.draw(st.sampled_from(hr.supported_pairs(adapter)), label="selector, scorer")
        pipe = hr.build_pipeline(
            target,
            draft if scheduler == "serial" else None,
            scheduler=scheduler,
            gamma=data.draw(hs.gammas, label="γ"),
            selector=selector,
            scorer=scorer,
            keep_ratio=data.draw(st.just(1.0) | hs.keep_ratios, label="keep ratio"),
            drafter="chain" if wrong is None else corrupting_drafter,
            drafter_options=None if wrong is None else {"wrong": wrong},
        )
        eager = data.draw(st.booleans(), label="compact eagerly")
        padding = data.draw(st.sampled_from([None, "left", "right"]), label="padded batch")
        seen.add(check_batch(pipe, prompts, gens, eager=eager, padding=padding))

    check()
    seen.check()


#: the parallel schedules' draft on a thread beside the target (a batch's producer: `hippo.engine._Beside`)
THREAD = {"executor": "inline", "executor_options": {"overlap": "thread"}}


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_parallel_schedules_batch_rows_equal_their_own_generate(adapter, corrupting_drafter):
    """`pearl` and `hippo` batched: q drafts each row's next block on a thread while p verifies this
    one (post-verify), or one token and the rest beside p after a rejection (pre-verify); each row is
    its own `target.generate`, token for token. A twin of the target as the draft (its own module,
    so it may run beside p), whole and pruned, with a corrupted position: rows mix 1-token
    pre-verify rounds, post-verify blocks accepted whole and in part, and rows leaving the batch.
    Then Hypothesis draws the rows, γ, keep ratio, draft (twin or the tiny draft) and corruption."""
    import copy

    target = hm.tiny(adapter, "target")
    twin = copy.deepcopy(target)
    prompts = fixed_prompts(adapter, target)
    blocks = {"pre": 0, "post": 0, "post partial": 0}

    def tally(outs):
        for o in outs:
            assert any("beside the target" in n for n in o.stats.notes), o.stats.notes
            for d, a in zip(o.stats.drafted_per_round, o.stats.accepted_per_round):
                blocks["pre"] += d == 1
                blocks["post"] += d > 1
                blocks["post partial"] += 0 < a < d and d > 1

    for scheduler, keep, wrong in (("pearl", 1.0, (0, 0, 1)), ("hippo", 0.5, (0, 1))):
        pipe = hr.build_pipeline(
            target, twin, scheduler=scheduler, gamma=3, keep_ratio=keep, executor=THREAD,
            drafter=corrupting_drafter, drafter_options={"wrong": wrong},
        )  # fmt: skip
        gens = [{"do_sample": False, "max_new_tokens": m} for m in (16, 3, 20)]
        tally(check_batch(pipe, prompts, gens))
        pipe.close()
    assert blocks["pre"] and blocks["post"] and blocks["post partial"], blocks

    @settings(max_examples=hs.examples(0.3))
    @given(data=st.data())
    def check(data):
        prompts, gens = draw_rows(data, adapter, target, 1)
        draft = twin if data.draw(st.booleans(), label="twin draft") else hm.tiny(adapter, "draft")
        wrong = data.draw(st.none() | hs.corrupt_patterns, label="corrupted positions")
        pipe = hr.build_pipeline(
            target,
            draft,
            scheduler=data.draw(st.sampled_from(["pearl", "hippo"]), label="scheduler"),
            gamma=data.draw(hs.gammas, label="γ"),
            keep_ratio=data.draw(st.just(1.0) | hs.keep_ratios, label="keep ratio"),
            executor=THREAD,
            drafter="chain" if wrong is None else corrupting_drafter,
            drafter_options=None if wrong is None else {"wrong": wrong},
        )
        tally(check_batch(pipe, prompts, gens))
        pipe.close()

    check()


#: `pearl` batched with its draft beside the target (a flattened twin of the target, often rejected),
#: on the simulated executor (the draft thread's blocks, drafted in the engine's thread: the same
#: tokens and draws, `test_a_parallel_batch_draws_the_same_on_a_thread`), γ = 3, the third draft
#: position corrupted: the
#: continuation q drafts beside p is corrupted at its third token, so a post-verify block is
#: accepted in part; 6 new tokens (the first post-verify block comes at the third round), and a
#: temperature that keeps the law peaked enough for power 0.95 within the run budget
PARALLEL_BATCH_LAW = {
    "scheduler": "pearl", "batch": True, "executor": "simulated", "draft": "flat", "gamma": 3,
    "corrupt": (False, False, True), "temperature": 0.006, "top_k": 2, "keep_ratio": 0.25, "new_tokens": 6,
}  # fmt: skip


def test_a_parallel_batch_draws_the_same_on_a_thread(corrupting_drafter):
    """A sampled `pearl` batch drafts the same blocks, and so draws the same tokens seed by seed,
    whether its draft drafts on a thread beside the target, with its rows in a draft process (a
    row's forked generator travels there when it joins) or in the engine's thread (the simulated
    executor's overlap, which the law check below runs)."""
    import copy

    target = hm.tiny("qwen2_5_vl", "target")
    draft = copy.deepcopy(target)
    prompts = [hm.Prompt.default("qwen2_5_vl", target, frames=f).inputs for f in (1, 2)]
    gen = {"do_sample": True, "max_new_tokens": 10, "top_k": 3, "temperature": 0.5}
    outs = {}
    executors = {"thread": THREAD, "process": {"executor": "process"}, "inline": {"executor": "simulated"}}
    for name, executor in executors.items():
        pipe = hr.build_pipeline(
            target, draft, scheduler="pearl", gamma=3, executor=executor,
            drafter=corrupting_drafter, drafter_options={"wrong": (0, 0, 1)},
        )  # fmt: skip
        outs[name] = [pipe.generate_batch(prompts, seeds=[s, s + 1], **gen) for s in range(4)]
        pipe.close()
    post = 0
    for a, b, c in zip(outs["thread"], outs["inline"], outs["process"]):
        for x, y, z in zip(a, b, c):
            assert torch.equal(x.sequences, y.sequences) and torch.equal(x.sequences, z.sequences)
            assert x.stats.accepted_per_round == y.stats.accepted_per_round == z.stats.accepted_per_round
            assert any("beside the target" in n for n in x.stats.notes + y.stats.notes)
            assert any("beside the target in its own process" in n for n in z.stats.notes)
            post += sum(d > 1 for d in x.stats.drafted_per_round)
    assert post, "no post-verify block was drafted beside the target"


@pytest.mark.matrix
def test_a_parallel_batch_row_samples_the_target_law():
    """Sampling beside the target in a batch: a row of a `pearl` batch of two (`BatchRow`), its draft
    on a thread with a fork of the row's generator, emits the target's exact law (power >= 0.95
    against TV 0.05; measured: 2,480 runs, TV 0.0038, 106 post-verify blocks accepted in part)."""
    res = config_check(PARALLEL_BATCH_LAW)
    assert res.power >= 0.95 and res.epsilon == 0.05 and res.partial_rounds > 0, res.summary()


#: the whole cost model fixed, whatever the batch size (t_decode 1, t_verify(2) 1.1, t_draft 0.2): γ = 1
#: pays at the prior α = 1/2 and loses once the rows' drafts are seen to be wrong
SWITCHY = {"verify": {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7, 17: 2.6}, "draft": 0.2}
#: a draft step as dear as a target step and 2 tokens verified twice as dear: even an always-right
#: draft loses, so `scheduler="auto"` runs the target alone
LOSING = {"verify": {1: 1.0, 2: 2.0, 17: 17.0}, "draft": 1.0}


def auto_pipeline(target, draft, scheduler, costs, cache_dir, **parts):
    """`serial` with gamma="auto", or `auto`, on `costs` (None: measured; `auto` caches them in
    `cache_dir`; `serial` is given one row's curve without t_draft, so each batch size is measured)."""
    if costs is None and scheduler == "serial":
        costs = {"verify": SWITCHY["verify"]}
    options = {"costs": costs, "cache_dir": str(cache_dir)}
    return hr.build_pipeline(target, draft, scheduler=scheduler, gamma="auto", executor=options, **parts)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_auto_batch_rows_equal_their_own_generate(adapter, corrupting_drafter, tmp_path):
    """The default schedule batched: `scheduler="auto"` (serial with γ re-chosen each round for the
    whole batch, or the target alone) and `serial` with gamma="auto"; costs fixed so that the rows
    switch between drafting and target-only steps (`SWITCHY`), or so that auto picks the target alone
    (`LOSING`), or measured (t_verify(B, k) timed on the batch, its forwards rolled back). Each row
    is its own `target.generate`; the check fails unless rows mixed drafted rounds and batched
    target-only steps, and both of auto's batch schedules ran."""
    target = hm.tiny(adapter, "target")
    seen = {"mixed": 0, "serial": 0, "autoregressive": 0, "measured": 0}

    def tally(pipe, scheduler, outs):
        seen["mixed"] += any(o.stats.target_steps and o.stats.rounds for o in outs)
        if scheduler == "auto":
            for o in outs:
                assert o.stats.plan["batch"] == len(outs)
                seen[o.stats.plan["schedule"]] += 1
        auto = _batch_gamma(pipe)
        seen["measured"] += auto is not None and bool(auto.batch_curves)

    # fixed batches first: auto on LOSING; auto on SWITCHY with every round's first draft token
    # wrong (drafting, then the target alone, probes); serial measuring t_verify(B, k)
    prompts = fixed_prompts(adapter, target)
    gens = [{"do_sample": False, "max_new_tokens": m} for m in (24, 5, 30)]
    for scheduler, costs, wrong in (
        ("auto", LOSING, None),
        ("auto", SWITCHY, (True,)),
        ("serial", None, (0, 1)),
    ):
        pipe = auto_pipeline(
            target,
            target,
            scheduler,
            costs,
            tmp_path,
            drafter=corrupting_drafter,
            drafter_options={"wrong": wrong or ()},
        )
        tally(pipe, scheduler, check_batch(pipe, prompts, gens))

    @settings(max_examples=hs.examples(0.4))
    @given(data=st.data())
    def check(data):
        prompts, gens = draw_rows(data, adapter, target, 2)
        scheduler = data.draw(st.sampled_from(["auto", "serial"]), label="scheduler")
        costs = data.draw(st.sampled_from([SWITCHY, SWITCHY, LOSING, None]), label="costs")
        role = data.draw(st.sampled_from(["self", "draft"]), label="draft")
        wrong = data.draw(st.none() | hs.corrupt_patterns, label="corrupted positions")
        pipe = auto_pipeline(
            target,
            target if role == "self" else hm.tiny(adapter, "draft"),
            scheduler,
            costs,
            tmp_path,
            keep_ratio=data.draw(st.just(1.0) | hs.keep_ratios, label="keep ratio"),
            drafter="chain" if wrong is None else corrupting_drafter,
            drafter_options=None if wrong is None else {"wrong": wrong},
        )
        assert pipe.can_batch()
        tally(
            pipe, scheduler, check_batch(pipe, prompts, gens, eager=data.draw(st.booleans(), label="eager"))
        )

    check()
    assert seen["mixed"] and seen["serial"] and seen["autoregressive"] and seen["measured"], seen


def _batch_gamma(pipe):
    """The AutoGamma a batch of the pipeline used (None: auto ran the target alone)."""
    return pipe.scheduler._batches if pipe.names["scheduler"] == "auto" else pipe.scheduler.auto


def test_t_verify_is_measured_once_per_batch_size_and_leaves_the_batch_as_it_was(monkeypatch, tmp_path):
    """t_verify(B, k) is timed on the batch the first time B rows are live, unless B lies between
    sizes already known (rows leaving make new sizes), and kept on the scheduler's AutoGamma for later
    batches; each measurement leaves the target's batched cache exactly as it found it (lengths,
    slots, validity, keys and values)."""
    from hippo.cli.video_commands import plan_lines  # what `hippo generate -v` prints

    target = hm.tiny("qwen2_5_vl", "target")
    prompts = fixed_prompts("qwen2_5_vl", target)
    gens = [{"do_sample": False, "max_new_tokens": m} for m in (16, 3, 24)]
    pipe = auto_pipeline(target, hm.tiny("qwen2_5_vl", "draft"), "serial", None, tmp_path)
    measured = []
    real = hst.BatchedCache.verify_curve

    def state(cache):
        kv = [t.clone() for layer in cache.cache.layers for t in (layer.keys, layer.values)]
        return list(cache.lengths), [list(s) for s in cache.slots], cache.valid.clone(), kv

    def spy(cache, widths, repeats=2):
        before = state(cache)
        curve = real(cache, widths, repeats)
        after = state(cache)
        assert before[:2] == after[:2] and torch.equal(before[2], after[2])
        assert all(torch.equal(x, y) for x, y in zip(before[3], after[3]))
        measured.append(cache.rows)
        assert curve(1) > 0 and set(curve.ks) == set(pipe.scheduler.auto.widths)
        return curve

    monkeypatch.setattr(hst.BatchedCache, "verify_curve", spy)
    outs = check_batch(pipe, prompts, gens)
    # B = 3 is timed; B = 2 lies between it and one row's curve (given), B = 1 is that curve
    assert measured == [3], measured
    for out in outs:  # each row's plan: the batch's choices at the row's own α, as `hippo generate -v` says
        alpha = out.stats.plan["gamma"]["alpha"]
        assert 0 < alpha < 1 and any(f"α {alpha:.2f}" in line for line in plan_lines(out.stats.plan))
    assert set(pipe.scheduler.auto.batch_curves) == set(measured)
    check_batch(pipe, prompts, gens)
    assert len(measured) == len(set(measured))  # kept: the second batch measured nothing new


def test_the_default_pipeline_decodes_a_batch_together():
    """The default schedule (`auto`) has a batched form: `Pipeline.map` decodes its greedy rows
    together, each row's plan says so, and each answer is the record's own `target.generate`."""
    from hippo.records import Record

    target = hm.tiny("qwen2_5_vl", "target")
    prompts = fixed_prompts("qwen2_5_vl", target)
    builder = hippo.PipelineBuilder().target(target).draft(hm.tiny("qwen2_5_vl", "draft"))
    pipe = builder.selector("uniform", keep_ratio=0.5).build()
    assert pipe.names["scheduler"] == "auto" and pipe.can_batch()
    records = [
        Record(str(i), inputs=p.inputs, generation={"max_new_tokens": 6 + 3 * i})
        for i, p in enumerate(prompts)
    ]
    got = {r.id: r for r in pipe.map(records, batch_size=3, do_sample=False)}
    for rec, p in zip(records, prompts):
        r = got[rec.id]
        assert any("batch of 3" in n for n in r.stats.notes), r.stats.notes
        assert r.stats.plan["batch"] == 3 and r.stats.plan["schedule"] in ("serial", "autoregressive")
        assert r.stats.plan["measured"]["tokens_per_second"] > 0  # each row's outcome, beside the plan
        want = hr.reference(target, p.inputs, do_sample=False, **rec.generation)[0, p.length :].tolist()
        assert r.token_ids == want


@pytest.mark.parametrize("adapter", ["qwen2_5_vl", "llava_onevision"])
def test_batch_drafts_what_batch_one_drafts(adapter, corrupting_drafter):
    """Each row of a batch is prefilled, pruned and drafted as `generate` does it alone: the same
    rounds accept the same numbers of draft tokens (a pruned self-draft with a corrupted third draft
    token), while rows finish at different rounds and leave the batch."""
    target = hm.tiny(adapter, "target")
    prompts = fixed_prompts(adapter, target)
    gens = [{"do_sample": False, "max_new_tokens": m} for m in (16, 5, 20)]
    pipe = hr.build_pipeline(
        target,
        target,
        gamma=4,
        keep_ratio=0.5,
        drafter=corrupting_drafter,
        drafter_options={"wrong": (0, 0, 1)},
    )

    def drafts_as_alone(pipe) -> list:
        outs = pipe.generate_batch([p.inputs for p in prompts], per_row=gens)
        for out, p, gen in zip(outs, prompts, gens):
            hr.assert_same(out, hr.reference(target, p.inputs, **gen), p.length)
            alone = pipe.generate(p.inputs, **gen).stats
            assert out.stats.accepted_per_round == alone.accepted_per_round
            assert out.stats.drafted_per_round == alone.drafted_per_round
        return outs

    outs = drafts_as_alone(pipe)
    assert len({o.stats.rounds for o in outs}) > 1  # rows finished at different rounds
    # the stock chain drafter: the plain rows' draft tokens stay on the device until the verdicts'
    # read, while a processed row (repetition penalty) drafts on the host in the same rounds
    gens[1] = {**gens[1], "max_new_tokens": 12, "repetition_penalty": 1.3}
    drafts_as_alone(hr.build_pipeline(target, target, gamma=4, keep_ratio=0.5))


def test_batched_form_is_refused_where_there_is_none():
    target = hm.tiny("qwen2_5_vl", "target")
    p = hm.Prompt.default("qwen2_5_vl", target)
    pipe = hr.build_pipeline(target, target, drafter="chain")
    assert pipe.can_batch() and pipe.scheduler.batch_gamma(None, 2) == 4
    assert hr.build_pipeline(target, target, drafter="chain", scheduler="pearl").can_batch()
    trees = hr.build_pipeline(target, target, drafter="tree", scheduler="serial")  # no batched form
    assert not trees.can_batch()
    with pytest.raises(UnsupportedError, match="no batched form.*token tree"):
        trees.generate_batch([p.inputs, p.inputs], max_new_tokens=2)


def test_sampling_rows_reproduce_their_batch_one_draws():
    """Sampling: each row uses its own generator exactly as `generate` does (q's draws, then the
    acceptance uniforms), so a seeded row of a batch equals the same seeded row decoded alone."""
    target = hm.tiny("qwen2_5_vl", "target")
    draft = hm.tiny("qwen2_5_vl", "draft")
    prompts = [hm.Prompt.default("qwen2_5_vl", target, frames=f) for f in (1, 2, 3)]
    pipe = hr.build_pipeline(target, draft, gamma=3)
    gen = {"do_sample": True, "max_new_tokens": 12, "top_k": 8}
    seeds = [11, 12, 13]
    outs = pipe.generate_batch([p.inputs for p in prompts], seeds=seeds, **gen)
    for out, p, seed in zip(outs, prompts, seeds):
        alone = pipe.generate(p.inputs, seed=seed, **gen)
        assert torch.equal(out.sequences, alone.sequences)
        assert out.stats.accepted_per_round == alone.stats.accepted_per_round


def test_a_batch_row_draws_what_batch_one_draws():
    """Sampling: a row of a batch draws, seed by seed, what batch 1 draws with the same γ
    (`coupled_config_check`: 59 seeds, power >= 0.95 against a row whose law is at TV 0.05 from batch
    1's, whose law `hippo check --sampling` checks at full power), on the harness's default case
    (a pruned self-draft, its second position corrupted), decoded as the second row of a batch of two
    beside another video and length (`BatchRow`, which checks every answer's notes say it was batched)."""
    res = config_check(BATCHED)
    assert res.power >= 0.95 and res.epsilon == 0.05 and res.runs == res.planned == 59, res.summary()
    assert res.partial_rounds > 0 and res.distinct > 1, res.summary()
    print(res.summary())


def test_map_decodes_greedy_rows_together_and_sampled_rows_alone():
    """`Pipeline.map` hands a batch's greedy rows to the batched engine, its sampled rows to
    `generate`; every answer is the record's own (greedy: `target.generate`; seeded: `generate`'s)."""
    from hippo.records import Record

    target = hm.tiny("qwen2_5_vl", "target")
    prompts = fixed_prompts("qwen2_5_vl", target)
    pipe = hr.build_pipeline(target, hm.tiny("qwen2_5_vl", "draft"), gamma=3)
    sampled = {"do_sample": True, "seed": 3, "top_k": 4}
    records = [
        Record("a", inputs=prompts[0].inputs, generation={"max_new_tokens": 7}),
        Record("b", inputs=prompts[1].inputs, generation={"max_new_tokens": 4, **sampled}),
        Record("c", inputs=prompts[2].inputs, generation={"max_new_tokens": 9}),
    ]
    got = {r.id: r for r in pipe.map(records, batch_size=3, do_sample=False)}
    for rec, p in zip(records, prompts):
        r, gen = got[rec.id], dict(rec.generation)
        together = any("batch of 2" in n for n in r.stats.notes)
        assert together == (rec.id != "b"), (rec.id, r.stats.notes)
        if rec.id == "b":
            seed = gen.pop("seed")
            assert r.token_ids == pipe.generate(p.inputs, seed=seed, **gen).sequences[0, p.length :].tolist()
        else:
            assert (
                r.token_ids == hr.reference(target, p.inputs, do_sample=False, **gen)[0, p.length :].tolist()
            )


def test_map_gives_a_bad_row_of_a_batch_its_own_error():
    """A row whose settings `generate` refuses gets its one-line error; the others of its batch are
    still decoded together and answered."""
    from hippo.records import Record

    target = hm.tiny("qwen2_5_vl", "target")
    prompts = fixed_prompts("qwen2_5_vl", target)
    pipe = hr.build_pipeline(target, hm.tiny("qwen2_5_vl", "draft"), gamma=3)
    records = [
        Record("a", inputs=prompts[0].inputs, generation={"max_new_tokens": 5}),
        Record("b", inputs=prompts[1].inputs, generation={"num_beams": 2}),
        Record("c", inputs=prompts[2].inputs, generation={"max_new_tokens": 6}),
    ]
    got = {r.id: r for r in pipe.map(records, batch_size=3, do_sample=False)}
    assert not got["b"].ok and "num_beams" in got["b"].error
    for rid, p, n in (("a", prompts[0], 5), ("c", prompts[2], 6)):
        assert any("batch of 2" in note for note in got[rid].stats.notes)
        want = hr.reference(target, p.inputs, do_sample=False, max_new_tokens=n)[0, p.length :].tolist()
        assert got[rid].token_ids == want


def run_arrivals(pipe, target, prompts, gens, arrive, cancel, seen) -> None:
    """Rows join the engine at round `arrive[i]` and row i is cancelled `cancel[i]` rounds after it
    joined (None: never) (`hippo.testing.batch.run_arrivals`); then each row is checked against its
    own decoding alone: `target.generate` when greedy, `generate` with its seed when sampled."""
    seeds = [g.get("seed") for g in gens]
    gens = [{k: v for k, v in g.items() if k != "seed"} for g in gens]
    jobs, counts = batch_check.run_arrivals(
        pipe, [(p.inputs, g) for p, g in zip(prompts, gens)], arrive, cancel, seeds
    )
    seen["joined_live"] += counts["joined_live"]
    seen["cancelled"] += counts["cancelled"]
    for job, p, g, seed in zip(jobs, prompts, gens, seeds):
        if g["do_sample"]:  # the same draws as the row's own generate with its seed
            ref = hr.new_tokens(pipe.generate(p.inputs, seed=seed, **g).sequences, p.length)
            seen["sampled"] += 1
        else:
            ref = hr.new_tokens(hr.reference(target, p.inputs, **g), p.length)
        if "cancelled" in job.stats.notes:
            assert job.tokens == ref[: len(job.tokens)]
        else:
            assert job.tokens == ref, "a seeded sample changed" if g["do_sample"] else "not the target's own"


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_rows_joining_and_leaving_mid_flight_equal_their_own_generate(adapter, corrupting_drafter):
    """Continuous batching (`hippo.engine.Engine`): rows join between rounds, some are cancelled, the
    others run to EOS or their budget. Hypothesis draws the arrival round of each row, which rows are
    cancelled and when, the schedule and which draft tokens are wrong. A greedy row that finishes is
    its own `target.generate`; a cancelled row holds a prefix of it; a seeded sampled row (fixed γ)
    is token for token its own `generate` with the same seed, whatever shared its batch."""
    target = hm.tiny(adapter, "target")
    seen = {"joined_live": 0, "cancelled": 0, "sampled": 0}
    sampled = {"do_sample": True, "temperature": 1.5, "seed": 7, "max_new_tokens": 6}
    fixed = hr.build_pipeline(target, target, gamma=3, keep_ratio=0.5)
    gens = [{"do_sample": False, "max_new_tokens": m} for m in (12, 10)] + [sampled]
    run_arrivals(fixed, target, fixed_prompts(adapter, target), gens, [0, 2, 1], [None, 1, None], seen)

    @settings(max_examples=hs.examples(0.4))
    @given(data=st.data())
    def check(data):
        prompts, gens = draw_rows(data, adapter, target, 2)
        scheduler = data.draw(st.sampled_from(["serial", "auto", "autoregressive"]), label="scheduler")
        wrong = data.draw(st.none() | hs.corrupt_patterns, label="corrupted positions")
        pipe = hr.build_pipeline(
            target,
            None if scheduler == "autoregressive" else target,
            scheduler=scheduler,
            gamma=data.draw(hs.gammas, label="γ"),
            keep_ratio=data.draw(st.just(1.0) | hs.keep_ratios, label="keep ratio"),
            # holistic top-k reads each row's own target prefill (rows arriving together are all
            # admitted before they join)
            **data.draw(
                st.sampled_from([{}, {"scorer": "holistic", "selector": "topk"}]), label="scorer and selector"
            ),
            drafter="chain" if wrong is None else corrupting_drafter,
            drafter_options=None if wrong is None else {"wrong": wrong},
        )
        row = data.draw(st.sampled_from([None, *range(len(gens))]), label="sampled row")
        if row is not None and scheduler == "serial":
            gens[row] = dict(sampled, max_new_tokens=gens[row]["max_new_tokens"])
        arrive = [data.draw(st.integers(0, 4), label=f"arrives {i}") for i in range(len(gens))]
        cancel = [
            data.draw(st.none() | st.integers(0, 3), label=f"cancelled after {i}") for i in range(len(gens))
        ]
        run_arrivals(pipe, target, prompts, gens, arrive, cancel, seen)

    check()
    assert all(seen.values()), f"vacuous: {seen}"


def test_the_batch_check_passes_the_engine_and_catches_a_row_that_never_rolls_back(monkeypatch):
    """`hippo.testing.batch` (what `hippo check` runs inside a batch): the honest engine passes with
    rows joining mid-flight and cancelled; an engine whose second row keeps its rejected KV fails."""
    from hippo.testing.report import LosslessViolation

    def build(case):
        return case.builder(scheduler="serial")

    ok = batch_check.assert_batch_lossless(build, adapters="qwen2_5_vl", examples=8, seed=1)
    assert ok.examples == 8 and ok.joined_live and ok.cancelled
    real = hst.BatchedCache.rollback

    def never_for_row_1(cache, row, length):
        if row != 1:
            real(cache, row, length)

    monkeypatch.setattr(hst.BatchedCache, "rollback", never_for_row_1)
    with pytest.raises(LosslessViolation, match="batched check FAILED"):
        batch_check.assert_batch_lossless(build, adapters="qwen2_5_vl", examples=8, seed=1, shrink=False)


def test_a_row_whose_sampling_fails_leaves_alone_and_the_others_finish():
    """A row's own failure inside a round (here its sampler raises, as a NaN law would) finishes that
    row with the exception on `job.error`; the other rows go on and are their own `target.generate`.
    `Engine.run` (generate_batch) then raises it."""
    target = hm.tiny("qwen2_5_vl", "target")
    prompts = fixed_prompts("qwen2_5_vl", target)
    pipe = hr.build_pipeline(target, target, gamma=3, keep_ratio=0.5)
    gens = [{"do_sample": False, "max_new_tokens": n} for n in (10, 12)] + [
        {"do_sample": True, "max_new_tokens": 10}
    ]
    jobs = [pipe.job(p.inputs, **g) for p, g in zip(prompts, gens)]

    def broken(*args, **kwargs):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    jobs[2].policy.draft_token = broken
    engine = pipe.engine()
    for job in jobs:
        engine.add(job)
    finished = []
    while engine.live:
        finished += engine.step()
    assert isinstance(jobs[2].error, RuntimeError) and any("failed" in n for n in jobs[2].stats.notes)
    assert finished.index(jobs[2]) == 0  # it left in the first round
    for job, p, g in zip(jobs[:2], prompts, gens):
        assert job.error is None and job.tokens == hr.new_tokens(
            hr.reference(target, p.inputs, **g), p.length
        )
    again = [pipe.job(p.inputs, **g) for p, g in zip(prompts, gens)]
    again[2].policy.draft_token = broken
    with pytest.raises(RuntimeError, match="probability tensor"):
        pipe.engine().run(again)


def test_a_batch_of_one_crops_what_it_rolls_back_and_runs_without_a_mask(monkeypatch):
    """One row: a rollback crops its last slots, so it keeps no holes and its forwards run without a
    mask, as a session's do, with the session's logits; once a second row joins, the masked forward
    takes over and the first row's logits are still its own session's (float64)."""
    target = hm.tiny("qwen2_5_vl", "target")
    adapter = hippo.registry.lookup("adapters", "qwen2_5_vl")(target)
    first, second = fixed_prompts("qwen2_5_vl", target)[:2]
    masks: list[bool] = []
    real = hst.step_logits
    monkeypatch.setattr(
        hst, "step_logits", lambda *a, **kw: masks.append("attention_mask" in kw) or real(*a, **kw)
    )
    cache = hst.BatchedCache([adapter.prefill(adapter.encode(first.inputs), None)])
    alone = adapter.prefill(adapter.encode(first.inputs), None)
    L, size = alone.length, cache.size
    torch.testing.assert_close(
        cache.forward([[5, 6, 7]])[0], alone.forward(torch.tensor([5, 6, 7])), rtol=0, atol=1e-12
    )
    cache.rollback(0, L + 1)
    alone.rollback(L + 1)
    assert cache.size == size + 1 and bool(cache.valid.all())
    torch.testing.assert_close(cache.forward([[8]])[0], alone.forward(torch.tensor([8])), rtol=0, atol=1e-12)
    assert masks == [False, False]
    cache.join([adapter.prefill(adapter.encode(second.inputs), None)])
    got = cache.forward([[9, 4], [3]])
    torch.testing.assert_close(got[0], alone.forward(torch.tensor([9, 4])), rtol=0, atol=1e-12)
    assert masks == [False, False, True]


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_the_host_books_of_a_stacked_cache_match_its_slots(data):
    """The slots each row holds are kept on the host (its prompt's `base` and its consumed `slots`), so
    rollback, cropping and compaction read nothing back: after every forward (rows of different
    widths, dummies included), rollback, join, row selection and compaction (eager or not), the
    books name exactly the valid slots; after a rollback of some tokens the last slot is held by some row (the tail
    no row holds is cropped)."""
    target = hm.tiny("qwen2_5_vl", "target")
    adapter = hippo.registry.lookup("adapters", "qwen2_5_vl")(target)
    prompts = fixed_prompts("qwen2_5_vl", target)

    def session(i: int):
        return adapter.prefill(adapter.encode(prompts[i % len(prompts)].inputs), None)

    def check(cache: hst.BatchedCache, cropped: bool = False) -> None:
        S = cache.size
        for b in range(cache.rows):
            books = torch.zeros(S, dtype=torch.bool)
            books[: cache.base[b]] = True
            books[cache.slots[b]] = True
            assert torch.equal(cache.valid[b], books), (b, cache.base[b], cache.slots[b])
        assert not cropped or S == 0 or bool(cache.valid[:, -1].any())

    saved = hst.COMPACT_MIN, hst.COMPACT_SHARE
    if data.draw(st.booleans(), label="compact eagerly"):
        hst.COMPACT_MIN, hst.COMPACT_SHARE = 1, 0.0
    try:
        cache = hst.BatchedCache([session(0), session(1)])
        check(cache)
        for _ in range(data.draw(st.integers(3, 10), label="operations")):
            op = data.draw(st.sampled_from(["forward", "rollback", "join", "select"]), label="op")
            if op == "forward":
                widths = data.draw(st.lists(st.integers(0, 3), min_size=cache.rows, max_size=cache.rows))
                if max(widths) == 0:
                    widths[0] = 1
                cache.forward([[7] * w for w in widths])
            elif op == "rollback":
                b = data.draw(st.integers(0, cache.rows - 1), label="row")
                drop = data.draw(st.integers(0, len(cache.slots[b])), label="drop")
                cache.rollback(b, cache.lengths[b] - drop)
                check(cache, cropped=drop > 0)
            elif op == "join" and cache.rows < 4:
                cache.join([session(cache.rows)])
            elif op == "select" and cache.rows > 1:
                keep = data.draw(st.lists(st.integers(0, cache.rows - 1), min_size=1, unique=True))
                cache.select(keep)
            cache.maybe_compact()
            check(cache)
    finally:
        hst.COMPACT_MIN, hst.COMPACT_SHARE = saved


class EveryThird(hippo.Scheduler):
    """A third-party schedule that is policy only: γ = 3 in every round, alone or in a batch, decoded
    on the engine loop both ways."""

    def batch_gamma(self, job, rows: int) -> int:
        return 3


class EveryThirdPlugin:
    @staticmethod
    @hippo.hookimpl
    def hippo_register_schedulers():
        return {"every_third": EveryThird}


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_third_party_schedule_decodes_alone_and_batched_on_the_engine_loop(adapter, corrupting_drafter):
    """A plugin's schedule that is policy only (`batch_gamma`): `generate` and `generate_batch` both equal `target.generate` (float64), with
    the same rounds alone as in the batch (a corrupted third draft token: partial and full rounds)."""
    target = hm.tiny(adapter, "target")
    prompts = fixed_prompts(adapter, target)
    gens = [{"do_sample": False, "max_new_tokens": m} for m in (14, 6, 11)]
    with registered(EveryThirdPlugin, "every-third", None):
        pipe = (
            hippo.PipelineBuilder()
            .target(target)
            .draft(target)
            .selector("uniform", keep_ratio=0.5)
            .drafter(corrupting_drafter, wrong=(0, 0, 1))
            .scheduler("every_third")
            .build()
        )
        assert pipe.can_batch()
        batched = pipe.generate_batch([p.inputs for p in prompts], per_row=gens)
        for out, p, gen in zip(batched, prompts, gens):
            ref = hr.reference(target, p.inputs, **gen)
            alone = pipe.generate(p.inputs, **gen)
            hr.assert_same(alone, ref, p.length)
            hr.assert_same(out, ref, p.length)
            assert alone.stats.drafted_per_round == out.stats.drafted_per_round
            assert alone.stats.accepted_per_round == out.stats.accepted_per_round
            assert 3 in alone.stats.drafted_per_round and max(alone.stats.drafted_per_round) == 3
            assert any(a < g for a, g in zip(alone.stats.accepted_per_round, alone.stats.drafted_per_round))


def test_a_job_alone_runs_its_rounds_on_the_engine_loop(monkeypatch):
    """`serial` and `autoregressive` decode one prompt with `Engine.step`, one call per round (a step
    of the target alone being one), on the job's own sessions and drafter."""
    target = hm.tiny("qwen2_5_vl", "target")
    p = hm.Prompt.default("qwen2_5_vl", target)
    steps: list[int] = []
    real = Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: steps.append(len(self.rows)) or real(self))
    for scheduler in ("serial", "autoregressive"):
        steps.clear()
        out = hr.build_pipeline(target, target, scheduler=scheduler).generate(p.inputs, max_new_tokens=9)
        hr.assert_same(out, hr.reference(target, p.inputs, max_new_tokens=9), p.length)
        rounds = out.stats.rounds if scheduler == "serial" else out.stats.new_tokens - 1
        assert rounds > 1 and steps == [1] * rounds, scheduler


@pytest.mark.parametrize("scheduler", ["serial", "pearl", "pearl, draft process"])
def test_every_draft_of_a_batch_is_what_a_fresh_draft_drafts(scheduler, monkeypatch):
    """q's state across rounds (its catch-up, what it consumed, chains kept on the device until the
    verdicts' read, a block drafted beside p, rows kept in a draft process) holds no trace a fresh
    draft would not: each row's proposal in each round equals q's greedy chain after the row's
    emitted tokens, drafted from a new prefill of its pruned prompt. A bookkeeping slip leaves the
    output exact (p verifies every token), so only this shows it. Plain rows beside a processed one
    (repetition penalty), one of them leaving before the others."""
    import hippo.engine as he

    target = hm.tiny("qwen2_5_vl", "target")
    prompts = fixed_prompts("qwen2_5_vl", target)
    gens = [{"do_sample": False, "max_new_tokens": m} for m in (16, 12, 20)]
    gens[1]["repetition_penalty"] = 1.3
    executor = {"pearl": THREAD, "pearl, draft process": {"executor": "process"}}.get(scheduler)
    options = {} if executor is None else {"executor": executor}
    scheduler = scheduler.split(",")[0]
    draft = target if scheduler == "serial" else copy.deepcopy(target)  # a self-draft has no thread
    pipe = hr.build_pipeline(target, draft, scheduler=scheduler, gamma=4, keep_ratio=0.5, **options)
    seen, verify = [], he._verify

    def spy(target_cache, rows, proposals, chains):
        for row, prop in zip(rows, proposals):
            if prop is not None and prop.size:
                seen.append((row.job, list(row.job.tokens), prop.tokens.tolist()))
        return verify(target_cache, rows, proposals, chains)

    monkeypatch.setattr(he, "_verify", spy)
    outs = pipe.generate_batch([p.inputs for p in prompts], per_row=gens)
    pipe.close()
    for out, p, gen in zip(outs, prompts, gens):
        hr.assert_same(out, hr.reference(target, p.inputs, **gen), p.length)
    assert len({id(job) for job, _, _ in seen}) == 3 and len(seen) > 10
    for job, emitted, drafted in seen:
        side = job.new_draft_side()
        side.prefill(job.kept)
        logits = side.session.forward(torch.tensor(emitted)) if emitted else None
        last = side.session.last_logits if logits is None else logits[-1]
        chain: list[int] = []
        for _ in drafted:
            seq = torch.cat([job.prompt_ids, torch.tensor([*emitted, *chain], dtype=torch.long)])
            x, _ = job.policy.draft_token(seq, last)
            chain.append(x)
            last = side.session.forward(torch.tensor([x]))[-1]
        assert chain == drafted, (emitted, drafted, chain)
