"""Sampling is lossless in law: the pipeline's first tokens follow exactly the target's distribution.

Each configuration of `hippo.testing.sampling.LAW_CONFIGS` (chain and tree drafting, the serial and
the parallel schedules, pearl included, every adapter, top_k, top_p, the repetition penalty and γ
from the cost model) is checked by
`assert_sampling_exact` on a law peaked enough for few runs but not more than MAX_MODE (its likeliest
sequence holds <= 0.9, so a pipeline that never samples fails), with as many runs as it takes to
detect any sampler whose law of the first tokens is at total variation 0.05 from the target's with
probability >= 0.95, at a false-alarm level of 2.5e-5 per check (1e-3 for the whole suite). The
numbers, and how they are computed: `python -m hippo.testing.sampling` (its module docstring).
Every check also requires a drafting accepted in part (`reference.partial_drafts`, which follows a
drafting across the chunks pearl and hippo verify it in).

The other law checks, on the same machinery: test_tree.py (a planted sibling rule is caught),
test_conversation.py (a conversation's second turn), test_planner.py (rounds and target-only steps).
"""

from __future__ import annotations

import pytest
import torch

from hippo.errors import ConfigError
from hippo.testing import assert_sampling_exact
from hippo.testing import models as hm
from hippo.testing import power as pw
from hippo.testing import reference as hr
from hippo.testing.matrix import PATHS
from hippo.testing.sampling import (
    BATCHED,
    COMPILED_TARGET,
    DEFAULTS,
    LAW_CONFIGS,
    MAX_MODE,
    SWITCHING,
    TREE_SETTINGS,
    LawCheck,
    config_check,
    config_law,
    generation,
    sampling_case,
    second_turn_law,
    target_law,
)
from hippo.types import Stats

# ---- the law checks -----------------------------------------------------------------------------------


def _available(cfg: dict) -> bool:
    adapter = cfg.get("adapter", "qwen2_5_vl")
    return adapter in hm.tiny_adapters() and cfg.get("scheduler", "serial") in hm.names("schedulers")


#: the configurations that are a path of the planted-bug matrix: the default tier checks each; the
#: others (other adapters, logits processors and tree shapes on paths already checked) carry the
#: `matrix` mark with the matrix's other cells: at about 2,000 runs a check they do not fit the
#: default tier's 12 minutes, and run in the second tier (`python -m pytest -m matrix`)
ON_A_PATH = {name for name, cfg in LAW_CONFIGS.items() if any(p.config is cfg for p in PATHS.values())}


def _marks(name: str, cfg: dict) -> list:
    if cfg.get("executor") == "process":
        # ~90 ms a run (the draft's own prefill in its process, the round trips): ~3 minutes at full
        # power, so with the matrix; its greedy collapse is caught in the suite (test_matrix.py)
        return [pytest.mark.xdist_group("processes"), pytest.mark.matrix]
    if cfg.get("scheduler") == "auto":
        # `auto` samples nothing itself: each job runs a stock drafting schedule with γ = "auto"
        # (`AutoScheduler.run`), whose honest law checks run here (serial and hippo with γ = "auto",
        # pearl); its greedy collapse is caught in the suite (test_matrix.py), its honest check in the
        # matrix tier (~2,000 runs, 50 s on 2 cores)
        return [pytest.mark.matrix]
    return [] if name in ON_A_PATH else [pytest.mark.matrix]


CONFIGS = [
    pytest.param(name, id=name.split(" (")[0].replace(" ", "-"), marks=_marks(name, cfg))
    for name, cfg in LAW_CONFIGS.items()
    if _available(cfg)
]


def test_every_law_configuration_is_checked_in_ci():
    """Every LAW_CONFIGS entry is a case of the honest law check below, in the default tier (CI) or the
    matrix tier: none is left out for a missing adapter or scheduler."""
    assert [p.values[0] for p in CONFIGS] == list(LAW_CONFIGS)
    for p in CONFIGS:
        assert {m.name for m in p.marks} <= {"matrix", "xdist_group"}, p.id  # no skip, no xfail


def _settings(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k in DEFAULTS}


@pytest.mark.parametrize("name", [p.values[0] for p in CONFIGS], ids=[p.id for p in CONFIGS])
def test_exact_law_is_what_generate_computes(name):
    """The enumeration's logits and processors agree with what `generate` used when it sampled, for
    each configuration's settings (repetition penalty, temperature, top-k, top-p)."""
    cfg = LAW_CONFIGS[name]
    opts = {**DEFAULTS, **_settings(cfg)}
    case = sampling_case(cfg.get("adapter"), new_tokens=opts["new_tokens"])
    target, L = case.target, case.prompt.length
    gen = generation(
        opts["temperature"], opts["top_k"], opts["top_p"], opts["repetition_penalty"], opts["new_tokens"]
    )
    proc = hr.warpers(opts["temperature"], opts["top_k"], opts["top_p"], opts["repetition_penalty"])
    torch.manual_seed(0)
    out = hr.reference(
        target, case.inputs, **gen, output_logits=True, output_scores=True, return_dict_in_generate=True
    )
    tokens = hr.new_tokens(out.sequences, L)
    for i in range(len(tokens)):
        raw = hr.next_logits(target, case.inputs, tokens[:i])  # [V], forced along the sampled path
        torch.testing.assert_close(raw, out.logits[i][0], rtol=0, atol=0)
        seq = out.sequences[:, : L + i]
        ours = torch.softmax(proc(seq, raw[None].double())[0], -1)  # [V] float64
        theirs = torch.softmax(out.scores[i][0].double(), -1)  # [V] generate's processed scores
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    law = config_law(cfg)
    assert abs(sum(law.values()) - 1.0) < 1e-12
    assert tuple(tokens) in law


@pytest.mark.parametrize("name", CONFIGS)
def test_pipeline_samples_the_target_law(name):
    """`assert_sampling_exact` at its stated power: it raises on a law at TV 0.05 with probability
    >= 0.95; here the pipeline is exact, so it must pass (false alarm <= 2.5e-5)."""
    res = config_check(LAW_CONFIGS[name])
    print(res.summary())
    assert res.power >= 0.95 and res.runs == res.planned == res.looks[-1], res.summary()
    assert res.partial_rounds > 0, res.summary()


def _laws() -> dict[str, dict]:
    """Every law the suite checks: LAW_CONFIGS, the default case, TREE_SETTINGS, the compiled target,
    the batched rows, a conversation's second turn and the planner's switching."""
    laws = {name: config_law(cfg) for name, cfg in LAW_CONFIGS.items() if _available(cfg)}
    laws["default (hippo check --sampling)"] = config_law({})
    laws["TREE_SETTINGS"] = config_law(TREE_SETTINGS)
    laws["COMPILED_TARGET"] = config_law(COMPILED_TARGET)
    laws["BATCHED"] = config_law(BATCHED)
    laws["SECOND_TURN"] = second_turn_law()
    laws["SWITCHING"] = target_law(sampling_case(), **SWITCHING)
    return laws


def test_every_law_check_can_see_a_greedy_collapse():
    """Every law the suite checks gives its likeliest sequence at most MAX_MODE = 0.9: a pipeline that
    always emits it is at TV >= 0.1 = 2 epsilon (`planted_greedy_collapse`, caught on every path:
    test_matrix.py); and each reaches the stated power within the default max_runs."""
    # configurations with the same settings share their law: one power search for each law
    seen: dict[tuple, str] = {}
    for name, law in _laws().items():
        key = tuple(sorted(law.items()))
        assert max(law.values()) <= MAX_MODE, (name, max(law.values()))
        if key in seen:
            continue
        seen[key] = name
        n = pw.runs_for(law, most=3000)
        assert pw.power_of(law, n) >= pw.POWER, (name, n)
        LawCheck.plan(law)  # the configuration's own assertion (mode and power) passes
    assert len(seen) > 1


def test_a_law_too_peaked_to_see_a_collapse_is_refused():
    """A law whose likeliest sequence holds more than 0.9 is refused before sampling: a pipeline that
    never samples could pass it."""
    from hippo.testing.report import VacuousCheck

    with pytest.raises(VacuousCheck, match="too peaked"):
        assert_sampling_exact(lambda case: case.builder("serial"), temperature=0.005)
    law = config_law({"temperature": 0.005})
    assert max(law.values()) > MAX_MODE
    assert LawCheck.plan(law, max_mode=1.0).runs > 0  # an explicit opt-out


def test_explicit_runs_below_the_stated_power_are_refused():
    """Power is enforced whatever `runs` is: 100 runs cannot reach 0.95 against a 5% TV error on the
    default law (VacuousCheck before sampling), unless the caller asks for a smoke run."""
    from hippo.testing.report import VacuousCheck

    law = config_law({})
    with pytest.raises(VacuousCheck, match="runs=100 detect"):
        LawCheck.plan(law, runs=100)
    with pytest.raises(VacuousCheck, match="runs=100 detect"):
        assert_sampling_exact(lambda case: case.builder("serial"), runs=100)
    smoke = LawCheck.plan(law, runs=100, require_power=False)
    assert smoke.runs == 100 and smoke.result.power < 0.95
    assert LawCheck.plan(law, runs=pw.runs_for(law)).result.power >= 0.95


def test_partial_drafts_follow_a_drafting_across_its_chunks():
    """The vacuity guard's count: draftings with some tokens accepted and some not. pearl
    books x_1 alone and then x_2 (no bonus token between): one drafting accepted in part. A serial
    round accepted whole ends with its bonus token: a rejection in the next round is a new drafting."""
    chunks = Stats()
    chunks.record_round(drafted=1, accepted=1, emitted=1, rejected=False)  # x_1, no bonus
    chunks.record_round(drafted=1, accepted=0, emitted=1, rejected=True)  # x_2 rejected: residual
    assert hr.partial_drafts(chunks) == 1  # though no round accepted part of its own tokens
    assert not any(0 < a < g for a, g in zip(chunks.accepted_per_round, chunks.drafted_per_round))
    serial = Stats()
    serial.record_round(drafted=2, accepted=2, emitted=3, rejected=False)  # all accepted + bonus
    serial.record_round(drafted=2, accepted=0, emitted=1, rejected=True)
    serial.record_round(drafted=2, accepted=1, emitted=2, rejected=True)  # partial in itself
    assert hr.partial_drafts(serial) == 1


def test_a_check_without_partial_acceptance_is_vacuous():
    """The target drafting for itself from the whole video, nothing corrupted: every drafting is
    accepted whole, so the law check proves nothing about the rule after a rejection and says so."""
    from hippo.testing.report import VacuousCheck

    with pytest.raises(VacuousCheck, match="no drafting was accepted in part"):
        assert_sampling_exact(
            lambda case: case.builder("serial"), keep_ratio=1.0, corrupt=None, runs=8, require_power=False
        )


def test_a_law_too_flat_for_the_power_is_refused():
    """Asking for the stated power on a flat law (T=1.5) cannot be met within max_runs: VacuousCheck,
    before sampling."""
    from hippo.testing.report import VacuousCheck

    with pytest.raises(VacuousCheck, match="too flat"):
        assert_sampling_exact(lambda case: case.builder("serial"), temperature=1.5, max_runs=200)


def test_an_unenumerable_law_is_a_config_error():
    with pytest.raises(ConfigError, match="too many to enumerate"):
        assert_sampling_exact(lambda case: case.builder("serial"), temperature=1.0, top_k=None, runs=1)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"do_sample": False, "penalty_alpha": 0.6, "top_k": 4}, "contrastive search"),
        ({"do_sample": False, "dola_layers": "high"}, "dola"),
        ({"do_sample": True, "guidance_scale": 1.5}, "guidance_scale"),
        ({"do_sample": True, "max_time": 5.0}, "max_time"),
    ],
)
def test_options_that_cannot_be_proven_lossless_are_refused(options, message):
    case = sampling_case()
    pipe = case.builder("serial", corrupt=False).build()
    try:
        with pytest.raises(ConfigError, match=message):
            pipe.generate(case.inputs, max_new_tokens=2, **options)
    finally:
        pipe.close()
