"""`assert_greedy_lossless`: hypothesis-driven, token-for-token comparison with `target.generate`.

Notation: p = target, q = draft, γ = draft length.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from hippo.testing._deps import require_hypothesis

require_hypothesis()

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import hippo  # noqa: E402
from hippo.errors import HippoError  # noqa: E402
from hippo.registry import registry  # noqa: E402
from hippo.testing import options as _options  # noqa: E402
from hippo.testing.case import EXECUTORS, Case  # noqa: E402
from hippo.testing.drafters import CORRUPTING, CorruptingDrafter, corrupting_plugin  # noqa: E402
from hippo.testing.models import eos_ids, pixel_unit, text_ids, tiny  # noqa: E402
from hippo.testing.reference import (  # noqa: E402
    eos_stop,
    first_difference,
    new_tokens,
    partial_rounds,
    path_logits,
)
from hippo.testing.report import LosslessViolation, Report, VacuousCheck  # noqa: E402
from hippo.testing.strategies import _adapters, cases  # noqa: E402
from hippo.types import GenerateOutput  # noqa: E402

Build = Callable[[Case], Any]  # Case -> PipelineBuilder | Pipeline

#: A float32 case (packed weights) may differ from `target.generate` only where p's two top logits
#: tie to within this fraction of the row's largest |logit|: a batched verification and a one-token
#: step round differently in float32 (about 1e-6 relative on the tiny models), so a larger gap is a bug.
FLOAT32_TIE = 1e-4


@attrs.define
class GreedyResult:
    """What a passing check saw, summed over its examples."""

    examples: int = 0
    rounds: int = 0  # verification rounds
    partial_rounds: int = 0  # rounds that accepted some but not all of their draft tokens
    rejected_rounds: int = 0  # rounds that rejected a draft token
    drafted: bool = False  # whether any pipeline had a draft
    ties: int = 0  # float32 examples that left target.generate's path at a float32 tie of p's logits

    def summary(self) -> str:
        return (
            f"{self.examples} examples, {self.rounds} verification rounds, {self.partial_rounds} with "
            f"partial acceptance, {self.rejected_rounds} with a rejection"
            + (f", {self.ties} float32 ties" if self.ties else "")
        )


# ---- naming what broke ------------------------------------------------------------------------------


def part_names(pipe: Any) -> dict[str, str]:
    """{kind: registered name} of a pipeline's parts (the corrupting drafter with its options)."""
    names = dict(getattr(pipe, "names", {}) or {})
    if names.get("scorer") == "auto":
        names["scorer"] = "none"
    drafter = getattr(pipe, "drafter", None)
    if isinstance(drafter, CorruptingDrafter):
        wrong = "".join("x" if w else "." for w in drafter.config.wrong)
        names["drafter"] = f"{drafter.config.base} (corrupted at {wrong})"
    for role in ("target", "draft"):
        adapter = getattr(pipe, f"{role}_adapter", None)
        if adapter is not None:
            names[f"{role} adapter"] = type(adapter).name or type(adapter).__name__
    return names


def _sources(pipe: Any) -> dict[str, str]:
    """{module of a part's class: 'kind name (source)'} for the parts of `pipe`."""
    out: dict[str, str] = {}
    for attr, kind in (
        ("scheduler", "schedulers"),
        ("drafter", "drafters"),
        ("verifier", "verifiers"),
        ("selector", "selectors"),
        ("scorer", "scorers"),
    ):
        part = getattr(pipe, attr, None)
        if part is None:
            continue
        for name, (cls, source) in registry(kind).items():
            if type(part) is cls:
                out.setdefault(type(part).__module__, f"{kind[:-1]} {name!r} from {source}")
    return out


def raising_part(pipe: Any, exc: BaseException) -> str | None:
    """'kind name (distribution version)' of the innermost part whose code raised `exc`."""
    sources = _sources(pipe)
    frames = [f.f_globals.get("__name__", "") for f, _ in traceback.walk_tb(exc.__traceback__)]
    for module in reversed(frames):
        if module in sources:
            return sources[module]
    return None


def _build_ref(build: Any) -> tuple[str, str]:
    """(import statement, expression) that name `build` in a reproduction line."""
    if hasattr(build, "reproduction"):
        return build.reproduction()
    module, qual = getattr(build, "__module__", None), getattr(build, "__qualname__", "")
    if module and qual and "<" not in qual and module != "__main__":
        head, _, _ = qual.partition(".")
        return f"from {module} import {head}; ", qual
    return "", "build"  # a lambda or a local function: the reader substitutes it


def raised(
    exc: BaseException,
    check: str,
    build: Any,
    case: Case,
    pipe: Any,
    where: str,
    who: str,
    want: list | None = None,
) -> LosslessViolation:
    """The report of a pipeline that raised on `case`: the part that raised (else `who`) and the
    traceback's last frames."""
    who = raising_part(pipe, exc) or who
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3))
    return LosslessViolation(
        Report(
            check=check,
            summary=f"{who} raised {type(exc).__name__}: {exc}",
            case=where,
            parts=part_names(pipe),
            want_tokens=want or [],
            reproduce=reproduction(build, case),
            counterexample=case,
            details=tb.rstrip(),
        )
    )


def reproduction(build: Any, case: Case) -> str:
    imports, expr = _build_ref(build)
    line = f"from hippo.testing import Case, replay_greedy; {imports}replay_greedy({expr}, {case!r})"
    if expr == "build":
        line += "   # build = your build function"
    return f'python -c "{line}"' if expr != "build" else line


# ---- one case ------------------------------------------------------------------------------------


def make_pipeline(build: Build, case: Case) -> tuple[Any, bool]:
    """(pipeline, whether the check built it and so closes it after use)."""
    made = build(case)
    if isinstance(made, hippo.PipelineBuilder):
        return made.build(), True
    if getattr(made, "closes_with_check", False):  # a wrapper the check's build made (`sampling.BatchRow`)
        return made, True
    if not hasattr(made, "generate"):
        raise HippoError(
            f"build(case) returned {type(made).__name__}; it must return a hippo.PipelineBuilder or a "
            "pipeline (an object with .generate)"
        )
    return made, False


def float_tie(case: Case, gen: dict, got: list[int], want: list[int], pos: int) -> bool:
    """Whether a float32 case's first difference from `target.generate` is a float32 tie: p's logit of
    the pipeline's token is within FLOAT32_TIE (relative) of the argmax's, at the reference's own
    position `pos` (after want[:pos]), and the token is not a stop token. Float64 cases have no ties."""
    if case.exact or pos >= len(got) or pos >= len(want):
        return False
    stops = gen.get("eos_token_id", eos_ids(case.target))
    if got[pos] in (stops if isinstance(stops, list) else [stops]):
        return False
    row = path_logits(case.target, case.inputs, want[:pos])[pos].double()  # [V]
    gap = float(row[want[pos]] - row[got[pos]])
    return 0.0 <= gap <= FLOAT32_TIE * max(1.0, float(row.abs().max()))


def run_case(build: Build, case: Case, made: tuple[Any, bool] | None = None) -> GenerateOutput:
    """Build the pipeline for `case`, generate, compare with target.generate; raise the report.

    Float64 cases must equal the reference exactly; a float32 case may leave the reference's path
    only at a float32 tie (`float_tie`), after which the paths are not comparable."""
    return checked_run(build, case, made)[0]


def checked_run(
    build: Build, case: Case, made: tuple[Any, bool] | None = None
) -> tuple[GenerateOutput, bool]:
    """`run_case`, and whether the output left the reference's path at a float32 tie."""
    pipe, owned = make_pipeline(build, case) if made is None else made
    target, inputs, L = case.target, case.inputs, case.prompt.length
    gen, ref = eos_stop(target, inputs, case.generation(), case.eos_pick)
    want = new_tokens(ref, L)
    try:
        out = pipe.generate(inputs, seed=case.seed, **gen)
    except HippoError:
        raise
    except Exception as exc:
        raise raised(exc, "greedy", build, case, pipe, case.short(), "a part of the pipeline", want) from exc
    finally:
        if owned:
            pipe.close()
    got = new_tokens(out.sequences.cpu(), L)
    pos = first_difference(got, want)
    tie = pos is not None and float_tie(case, gen, got, want, pos)
    if not tie and (pos is not None or not torch.equal(out.sequences.cpu(), ref.cpu())):
        pos = 0 if pos is None else pos
        raise LosslessViolation(
            Report(
                check="greedy",
                summary="the pipeline's tokens are not target.generate's",
                case=case.short(),
                parts=part_names(pipe),
                position=pos,
                got=got[pos] if pos < len(got) else None,
                want=want[pos] if pos < len(want) else None,
                got_tokens=got,
                want_tokens=want,
                reproduce=reproduction(build, case),
                counterexample=case,
                details=f"stats: {_stats_line(out)}",
            )
        )
    _check_rounds(out, build, case, pipe)
    return out, tie


def _stats_line(out: GenerateOutput) -> str:
    s = out.stats
    return f"rounds={s.rounds} drafted={s.drafted_per_round} accepted={s.accepted_per_round}"


def _check_rounds(out: GenerateOutput, build: Build, case: Case, pipe: Any) -> None:
    """The round bookkeeping is consistent (a schedule that emits past the verifier shows here too)."""
    s = out.stats
    problems = []
    if not len(s.accepted_per_round) == len(s.drafted_per_round) == s.rounds:
        problems.append("per-round lists and the round count disagree")
    if not all(0 <= n <= g for n, g in zip(s.accepted_per_round, s.drafted_per_round)):
        problems.append("a round accepted more tokens than it drafted")
    if problems:
        raise LosslessViolation(
            Report(
                check="greedy",
                summary="; ".join(problems),
                case=case.short(),
                parts=part_names(pipe),
                reproduce=reproduction(build, case),
                counterexample=case,
                details=f"stats: {_stats_line(out)}",
            )
        )


def replay_greedy(build: Build, case: Case) -> GenerateOutput:
    """Run one case (e.g. a reported counterexample) again; raises LosslessViolation if it fails."""
    with corrupting_plugin():
        return run_case(build, case)


def partial_case(adapter: str, executor: str = "inline", dtype: str = "float64") -> Case:
    """A case that accepts part of a draft for sure: the target drafts for itself from every visual
    token (so its drafts are right) and the third token of each drafting is corrupted, so a serial
    round emits three tokens, and the token budget (11) leaves the last round one token (such
    rounds once booked tokens they never emitted). A block the parallel schedules draft beside p
    is verified from its second token on (its first is q's guess of p's next token, checked when
    p emits it), so the corrupted token falls in the verified block there too."""
    model = tiny(adapter)
    unit, words = pixel_unit(model), text_ids(model)
    return Case(
        adapter,
        (2, 2 * unit, 2 * unit),
        words[3:6],
        words[7:9],
        draft="self",
        gamma=4,
        keep_ratio=1.0,
        max_new_tokens=11,
        wrong=(False, False, True),
        executor=executor,
        dtype=dtype,
    )


def regression_cases(adapter: str, executor: str = "inline", dtype: str = "float64") -> list[Case]:
    """Fixed examples every check runs whatever hypothesis draws (hypothesis explores new cases each
    run; these stay): `partial_case`, partial acceptance with its last round cut by the budget."""
    return [partial_case(adapter, executor, dtype)]


def fixed_value(strategy: st.SearchStrategy) -> tuple[bool, Any]:
    """(True, a value `strategy` can draw) for sampled_from/just (the first element) and booleans
    (False); (False, None) for strategies whose values cannot be read off."""
    inner = getattr(strategy, "wrapped_strategy", strategy)
    elements = getattr(inner, "elements", None)
    if elements:
        return True, elements[0]
    if type(inner).__name__ == "BooleansStrategy":
        return True, False
    return False, None


def fixed_extra(draws: Mapping[str, st.SearchStrategy] | None) -> dict | None:
    """`case.extra` for the fixed examples: each draw's first value, or None if one has none."""
    extra = {}
    for name, strategy in (draws or {}).items():
        ok, value = fixed_value(strategy)
        if not ok:
            return None
        extra[name] = value
    return extra


# ---- the property ---------------------------------------------------------------------------------


def hypothesis_settings(examples: int | None, seed: int | None, shrink: bool = True) -> settings:
    """The active profile's settings, with `examples` and without deadlines or slow-data warnings;
    `shrink=False` reports the first counterexample found instead of the smallest."""
    n = examples if examples is not None else _options.default_examples()
    kw: dict[str, Any] = dict(
        max_examples=max(1, int(n)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        report_multiple_bugs=False,
    )
    if seed is not None:
        kw.update(derandomize=False, database=None)
    skip = {"explain"} if shrink else {"explain", "shrink"}  # explain: costly, and not in the report
    kw["phases"] = [p for p in settings().phases if p.name not in skip]
    return settings(settings(), **kw)


def assert_greedy_lossless(
    build: Build,
    *,
    adapters: Sequence[str] | str | None = None,
    examples: int | None = None,
    seed: int | None = None,
    corrupt: bool = True,
    self_draft: bool | None = None,
    executors: Sequence[str] = EXECUTORS,
    draws: Mapping[str, st.SearchStrategy] | None = None,
    stops: bool = True,
    require_partial: bool = True,
    shrink: bool = True,
    max_shrinks: int = 100,
    on_output: Callable[[Case, GenerateOutput], None] | None = None,
    seeds_of_models: st.SearchStrategy[int] | None = None,
    gamma: st.SearchStrategy[int | str] | None = None,
    dtypes: Sequence[str] = ("float64",),
) -> GreedyResult:
    """Check that `build(case)`'s pipeline returns exactly `target.generate(...)` on drawn cases.

    `build` takes a `Case` and returns a `hippo.PipelineBuilder` or a pipeline; `case.builder(...)`
    is a builder already holding the case's tiny pair, γ, keep ratio, corrupted drafter and executor.
    `adapters`: the adapters whose tiny pairs are drawn (default: all that have one); `examples`:
    hypothesis examples (default: `--hippo-examples`, else the active hypothesis profile's);
    `seed`: a fixed hypothesis seed (default: the profile's behaviour). `draws` are extra
    strategies whose values land in `case.extra`; `stops=False` draws no min_new_tokens or mid-way
    EOS; `on_output(case, out)` may add assertions; `seeds_of_models` draws the tiny models' seeds
    (`st.just(0)`: one pair, when every new model costs a compilation);
    `gamma` draws γ (default 1-8; `strategies.gammas_or_auto` adds "auto"); `dtypes` the pairs'
    dtypes: "float64" (exact) and/or "float32", where the target's packed linear weights (hippo's
    default) are live and the output may leave `target.generate`'s path only at a float32 tie of
    p's two top logits (`float_tie`, FLOAT32_TIE);
    `shrink=False` skips hypothesis's shrinking (faster, the first counterexample is reported);
    shrinking stops after `max_shrinks` tries, reporting the smallest failing case so far (a count,
    not a time, so a seed reproduces the same report on any machine).

    With `corrupt` (and a draft that may be the target itself), `regression_cases` run first, with
    each of `draws`' first values in `case.extra` (when every draw is a sampled_from, just or
    booleans): one of them accepts part of a draft for sure.

    Raises `LosslessViolation` with the shrunk counterexample's report, or `VacuousCheck` when the
    pipelines drafted but no round ever accepted some but not all of its draft tokens (with
    `require_partial`). Returns a `GreedyResult`.
    """
    result = GreedyResult()
    failed: list[Case] = []  # every case that failed, and the tries since the first failure
    tries = [0]
    strategy = cases(
        adapters,
        corrupt=corrupt,
        self_draft=self_draft,
        executors=executors,
        draws=draws,
        stops=stops,
        seeds_of_models=seeds_of_models,
        gamma=gamma,
        dtypes=dtypes,
    )

    def lossless(case: Case) -> None:
        # After `max_shrinks` tries, only cases that already failed run (and fail again, for
        # hypothesis's final replay of the smallest); every other candidate passes at once, so
        # shrinking ends with the smallest failing case found so far.
        if failed:
            tries[0] += 1
            if tries[0] > max_shrinks and case not in failed:
                return
        try:
            checked(case)
        except (LosslessViolation, AssertionError):
            failed.append(case)
            raise

    def checked(case: Case) -> None:
        made = make_pipeline(build, case)
        drafts = getattr(made[0], "draft_adapter", None) is not None
        out, tie = checked_run(build, case, made)
        if on_output is not None:
            on_output(case, out)
        s = out.stats
        result.examples += 1
        result.drafted = result.drafted or drafts
        result.rounds += s.rounds
        result.partial_rounds += len(partial_rounds(out))
        result.rejected_rounds += sum(n < g for n, g in zip(s.accepted_per_round, s.drafted_per_round))
        result.ties += int(tie)

    # Derandomized profiles seed hypothesis from the test function: make it differ per calling
    # test (and pytest param) and per adapter set, so each call explores its own cases.
    where = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    lossless._hypothesis_internal_add_digest = f"{where}|{_adapters(adapters)}".encode()
    lossless = hypothesis_settings(examples, seed, shrink)(given(case=strategy)(lossless))
    extra = fixed_extra(draws)
    if corrupt and self_draft is not False and extra is not None:
        fixed_gamma = fixed_value(gamma) if gamma is not None else (False, None)
        for case in reversed(regression_cases(_adapters(adapters)[0], executors[0], dtypes[0])):
            case = attrs.evolve(case, extra=extra)
            if fixed_gamma[0]:
                case = attrs.evolve(case, gamma=fixed_gamma[1])
            lossless = example(case=case)(lossless)
    if seed is not None:
        lossless = hypothesis_seed(seed)(lossless)
    with corrupting_plugin():
        lossless()
    if require_partial and result.drafted and not result.partial_rounds:
        raise VacuousCheck(
            f"no round accepted some but not all of its draft tokens over {result.summary()}: the "
            "partial-acceptance path was never exercised, so this check proves little. Build with "
            f"case.builder(...) (it corrupts drawn draft positions through the {CORRUPTING!r} drafter), "
            "use more examples, or pass require_partial=False"
        )
    return result
