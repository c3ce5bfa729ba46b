"""Coupled checks: a path that promises the same draws as a law-checked reference, seed by seed.

Some paths promise more than the target's law. A row of a batch draws what batch 1 draws with the
same γ and seed; a compiled target what the eager one draws; a conversation's later turn what
`generate` draws on the whole conversation's prompt. For those paths the check is the promise
itself: run the path and its reference on the same seeds, and fail at the first seed whose tokens
differ.

Power, against the same errors as a law check: if the path's law Q is at total variation ε from the
reference's law P, every coupling of the two (here: the shared seed) differs with probability at
least ε (the coupling inequality, P(X ≠ Y) >= TV(Q, P)). So K seeds all agree with probability at
most (1 - ε)^K: `coupled_runs()` = 59 seeds detect a 5% error with probability >= 0.95, where a law
check needs about 2,000 runs. The reference's own law is checked against the target's at full
power elsewhere (a law check of the same configuration); a path that keeps its promise never fails.
Notation: p = target, q = draft, γ = draft length, ε = total-variation error, K = seeds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

from hippo.errors import ConfigError
from hippo.testing import power as pw
from hippo.testing.reference import partial_drafts
from hippo.testing.report import LosslessViolation, Report, VacuousCheck


def coupled_runs(epsilon: float = pw.EPSILON, power: float = pw.POWER) -> int:
    """The fewest seeds K with 1 - (1 - epsilon)^K >= power."""
    return math.ceil(math.log(1.0 - power) / math.log(1.0 - epsilon))


@attrs.define
class CoupledResult:
    runs: int = 0
    planned: int = 0
    power: float = 0.0  # against a path at TV `epsilon` from the reference: 1 - (1 - ε)^K
    epsilon: float = pw.EPSILON
    distinct: int = 0  # distinct sequences the reference drew: the seeds did sample
    rounds: int = 0
    partial_rounds: int = 0  # draftings accepted in part, in the path's runs

    def summary(self) -> str:
        return (
            f"{self.runs} seeds drew the reference's tokens ({self.distinct} distinct sequences); detects a "
            f"path at TV {self.epsilon:g} from it with power {self.power:.3f}; {self.partial_rounds} draftings "
            f"accepted in part over {self.rounds} rounds"
        )


#: (seed) -> (the new tokens, the run's stats or None)
Run = Callable[[int], tuple[list[int], Any]]


def assert_same_draws(
    path: Run,
    reference: Run,
    *,
    what: str,
    case: str,
    parts: dict | None = None,
    reproduce: str = "",
    seed: int = 0,
    runs: int | None = None,
    epsilon: float = pw.EPSILON,
    power: float = pw.POWER,
    require_partial: bool = True,
    require_power: bool = True,
) -> CoupledResult:
    """Run `path` and `reference` on seeds seed, seed+1, ... (`runs`, default `coupled_runs`) and
    compare their new tokens. `LosslessViolation` at the first seed where they differ (`what` names
    the promise, e.g. "a batch row draws what batch 1 draws"); `VacuousCheck` before any seed when an
    explicit `runs` detects a TV `epsilon` error with less than `power` (as `LawCheck.plan`;
    `require_power=False`: a smoke run, its power only reported), when the reference drew one
    sequence on every seed (nothing was sampled) or, with `require_partial`, when no drafting of the
    path was accepted in part."""
    if not 0 < epsilon < 1 or not 0 < power < 1:
        raise ConfigError(f"epsilon and power must be in (0, 1), got {epsilon}, {power}")
    n = coupled_runs(epsilon, power) if runs is None else runs
    res = CoupledResult(planned=n, power=1.0 - (1.0 - epsilon) ** n, epsilon=epsilon)
    if res.power < power and require_power:
        raise VacuousCheck(
            f"runs={n} seeds detect a path at TV {epsilon:g} from its reference with power {res.power:.3f} "
            f"only, not {power:g} ({case}): raise runs to {coupled_runs(epsilon, power)} or more (or leave "
            "runs=None, the check picks it), or pass require_power=False for a smoke run"
        )
    seen: set[tuple[int, ...]] = set()
    for s in range(seed, seed + n):
        want, _ = reference(s)
        got, stats = path(s)
        got, want = list(got), list(want)
        res.runs += 1
        seen.add(tuple(want))
        if stats is not None:
            res.rounds += stats.rounds
            res.partial_rounds += partial_drafts(stats)
        if got != want:
            position = next(
                (i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want))
            )
            report = Report(
                check="sampling",
                summary=(
                    f"seed {s}: the path drew {got}, its reference {want}; {what}, so the "
                    "path's law is not the reference's (checked against the target's)"
                ),
                case=case,
                parts=parts or {},
                position=position,
                got_tokens=got,
                want_tokens=want,
                reproduce=reproduce,
                details=res.summary(),
            )
            raise LosslessViolation(report, res)
    res.distinct = len(seen)
    if res.distinct < 2:
        raise VacuousCheck(f"the reference drew one sequence on all {n} seeds: nothing was sampled ({case})")
    if require_partial and not res.partial_rounds:
        raise VacuousCheck(f"no drafting of the path was accepted in part: {res.summary()}")
    return res


__all__ = ["CoupledResult", "assert_same_draws", "coupled_runs"]
