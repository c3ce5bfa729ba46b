"""The coupled check (`hippo.testing.coupled`): its number of seeds, its power, and what it reports.

The suite's coupled paths (a batch row, a compiled target, a conversation's later turn) are in
test_batched.py, test_static.py and test_conversation.py, and their planted-bug cells in
test_matrix.py; here the check itself, on runs given as functions of the seed.
"""

from __future__ import annotations

import random

import pytest

from hippo.testing import CoupledResult, LosslessViolation, assert_same_draws
from hippo.testing.coupled import coupled_runs
from hippo.testing.report import VacuousCheck
from hippo.types import Stats

LAW = [((1, 2), 0.6), ((1, 3), 0.3), ((4, 2), 0.1)]


def draw(seed: int) -> list[int]:
    """A sampler of LAW, deterministic in the seed."""
    u = random.Random(seed).random()
    for tokens, p in LAW:
        if u < p:
            return list(tokens)
        u -= p
    return list(LAW[-1][0])


def partial_stats() -> Stats:
    s = Stats()
    s.accepted_per_round, s.drafted_per_round, s.emitted_per_round, s.rejected_per_round = [1], [2], [2], [1]
    s.rounds = 1
    return s


def run(seed: int) -> tuple[list[int], Stats]:
    return draw(seed), partial_stats()


def test_59_seeds_detect_a_5_percent_error_with_power_095():
    """(1 - ε)^K <= 1 - power: the chance that every seed of a path at TV ε agrees with its reference."""
    k = coupled_runs(0.05, 0.95)
    assert k == 59
    assert (1 - 0.05) ** k <= 0.05 < (1 - 0.05) ** (k - 1)
    assert coupled_runs(0.1, 0.95) == 29


def test_a_path_that_keeps_its_promise_passes():
    res = assert_same_draws(run, run, what="the same sampler", case="fake")
    assert isinstance(res, CoupledResult)
    assert res.runs == res.planned == 59 and res.power >= 0.95
    assert res.distinct == 3 and res.partial_rounds == 59, res.summary()


def test_a_path_off_by_tv_005_is_caught_within_the_seeds():
    """A path that draws differently on 5% of the seeds (a law 5% off, coupled as well as it can be)
    is caught, and the report names the seed, both draws and the promise."""

    def path(seed: int) -> tuple[list[int], Stats]:
        tokens = draw(seed)
        if random.Random(10**6 + seed).random() < 0.05:
            tokens = [9, 9]
        return tokens, partial_stats()

    caught = 0
    for offset in range(0, 2000, 100):
        try:
            assert_same_draws(
                path, run, what="the path must draw what the reference draws", case="fake", seed=offset
            )
        except LosslessViolation as exc:
            caught += 1
            report = exc.report
            assert (
                "the path drew [9, 9]" in report.summary
                and "must draw what the reference draws" in report.summary
            )
            assert report.got_tokens == [9, 9] and exc.result.runs <= 59
    assert caught >= 17, caught  # power 0.95: at least 17 of 20 with room for chance (P(< 17) ~ 2%)


def test_a_reference_that_never_samples_is_vacuous():
    def one(seed: int) -> tuple[list[int], Stats]:
        return [1, 2], partial_stats()

    with pytest.raises(VacuousCheck, match="one sequence"):
        assert_same_draws(one, one, what="-", case="fake")


def test_a_path_that_never_drafts_in_part_is_vacuous():
    def undrafted(seed: int) -> tuple[list[int], Stats]:
        return draw(seed), Stats()

    with pytest.raises(VacuousCheck, match="accepted in part"):
        assert_same_draws(undrafted, run, what="-", case="fake")
    assert assert_same_draws(undrafted, run, what="-", case="fake", require_partial=False).runs == 59


def test_explicit_runs_below_the_stated_power_are_refused():
    """Power is enforced as the law check enforces it (`LawCheck.plan`): 20 seeds detect a 5% error
    with power 0.64 only, so the check refuses before any seed is run and names what to raise, unless
    the caller asks for a smoke run; 59 seeds or more pass."""
    ran = []

    def counted(seed: int) -> tuple[list[int], Stats]:
        ran.append(seed)
        return run(seed)

    with pytest.raises(
        VacuousCheck, match=r"runs=20 seeds .* power 0\.642 only, not 0\.95.*raise runs to 59"
    ):
        assert_same_draws(counted, counted, what="-", case="fake", runs=20)
    assert ran == []  # refused before sampling
    smoke = assert_same_draws(run, run, what="-", case="fake", runs=20, require_power=False)
    assert smoke.runs == 20 and smoke.power < 0.95
    assert assert_same_draws(run, run, what="-", case="fake", runs=80).power >= 0.95
    with pytest.raises(VacuousCheck, match="runs=59 seeds .* not 0.99"):
        assert_same_draws(run, run, what="-", case="fake", runs=59, power=0.99)
