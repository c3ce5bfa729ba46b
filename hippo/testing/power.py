"""The law test's statistics and their power: exact binomial tests on the first tokens' joint law.

`assert_sampling_exact` runs a pipeline N times and compares the law of its first m generated tokens
with the target's exact law P (enumerated from the target's own forward passes). The outcomes are
grouped into K cells (`cells`: each sequence with P >= `CELL_MIN` alone, the rest in one cell, at
most `MAX_CELLS`, and a cell of P = 0 for the sequences the target cannot emit). Then, for every set of cells A (up to complement: 2^(K-1) - 1 sets), the number
of runs in A, O(A) ~ Binomial(N, P(A)) for an exact sampler, gets an exact two-sided binomial test
at level α / (sets × looks). The check fails when any of them rejects.

Level: exact (binomial tails, Bonferroni over the sets and looks), whatever the counts: no χ²
approximation, which is far off in the tails of a peaked law's rare cells.

Power against *any* sampler whose law Q of the cells is at total variation ε from P: the set
A* = {cells where Q > P} has Q(A*) = P(A*) + ε, so the test on A* sees a shift of ε. Hence the
check detects every such sampler with probability at least
    min over sets A of P_{O ~ Binomial(N, P(A) ± ε)}(the test on A rejects),
computed exactly (`worst_power`). A shift on a set with P(A) near 1/2 is the hardest to see; a
peaked law (one sequence holding most of P) has no such set, which is why the law tests sample
low-temperature, top-k heads and why N depends on the law (`runs_for`). But no more peaked than
`sampling.MAX_MODE` (the likeliest sequence <= 0.9): a pipeline that never samples must be at least
2 ε away, so N is about 2000 for every check.

Sequential looks: a check tests after N/10, 3N/10 and N runs (each look at α / 3 of its level) and
stops at the first that rejects; a broken pipeline is usually caught at the first look, an exact
one runs all N. The power above is that of the last look alone (a lower bound).

The suite's false-alarm rate per CI run is at most the sum of its law checks' levels: `SUITE_ALPHA`
split over `SUITE_CHECKS` checks of exact pipelines (Bonferroni), `ALPHA` each.

Run `python -m hippo.testing.sampling` for the numbers of the suite's configurations (it builds the
tiny models and enumerates each law: about a minute).
Notation: N = runs, K = cells, ε = total-variation error, α = a check's false-alarm rate.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import lru_cache

import torch

#: False-alarm rate of the whole suite per CI run, split evenly (Bonferroni) over its law checks.
SUITE_ALPHA = 1e-3
#: Law checks of exact pipelines in one CI run (both tiers: `.ci/run`), counted with room to spare: the
#: 11 configurations of tests/lossless/test_sampling.py, the installed honest twin of
#: tests/test_testing.py (`hippo check fixed_chain --sampling --law default`: 1 check), the planner's
#: switching x 2, and `hippo check tree --sampling` on the 4 built-in backbones (tests/lossless/
#: test_law_cases.py: token trees, the default case, a conversation's turn 2: 12) and on a third
#: party's (the default case: 1): 27. The coupled
#: checks (`hippo.testing.coupled`) cannot raise a false alarm, and the planted-bug matrix
#: (tests/lossless/test_matrix.py) runs broken pipelines: a rejection there is the expected outcome.
SUITE_CHECKS = 40
ALPHA = SUITE_ALPHA / SUITE_CHECKS  # 2.5e-5 per check
EPSILON = 0.05  # the total-variation error every check must detect ...
POWER = 0.95  # ... with at least this probability
CELL_MIN = 0.002  # sequences less likely than this share one cell
MAX_CELLS = 8
LOOKS = (0.1, 0.3, 1.0)  # fractions of N at which a check tests (a broken pipeline stops early)


# ---- binomial tails, exact in float64 ---------------------------------------------------------


def binomial_pmfs(n: int, ps: Sequence[float]) -> torch.Tensor:  # -> [len(ps), n + 1]
    """The Binomial(n, p) pmf for each p, one row each (p <= 0 or >= 1: all mass on 0 or n)."""
    k = torch.arange(n + 1, dtype=torch.float64)
    out = torch.zeros(len(ps), n + 1, dtype=torch.float64)
    inner = []  # the rows with 0 < p < 1
    for i, p in enumerate(ps):
        if 0.0 < p < 1.0:
            inner.append(i)
        else:
            out[i, 0 if p <= 0.0 else n] = 1.0
    if inner:
        logc = math.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
        log_p = torch.tensor([math.log(ps[i]) for i in inner], dtype=torch.float64)[:, None]
        log_q = torch.tensor([math.log1p(-ps[i]) for i in inner], dtype=torch.float64)[:, None]
        out[inner] = torch.exp(logc + k * log_p + (n - k) * log_q)
    return out


def binomial_pmf(n: int, p: float) -> torch.Tensor:  # -> [n + 1]
    return binomial_pmfs(n, [p])[0]


def thresholds_of(n: int, ps: Sequence[float], alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo [len(ps)], hi [len(ps)]): for each p, the two-sided exact test at level alpha (alpha/2 each
    tail) rejects O <= lo or O >= hi (lo = -1, hi = n + 1: that tail never rejects)."""
    pmf = binomial_pmfs(n, ps)  # [S, n + 1]
    lower = torch.cumsum(pmf, 1)  # P(O <= k), nondecreasing in k
    upper = torch.flip(torch.cumsum(torch.flip(pmf, [1]), 1), [1])  # P(O >= k), nonincreasing
    lo = (lower <= alpha / 2).sum(1) - 1  # the last k of the prefix where P(O <= k) <= alpha / 2
    hi = (n + 1) - (upper <= alpha / 2).sum(1)  # the first k of the suffix where P(O >= k) <= alpha / 2
    return lo, hi


@lru_cache(maxsize=4096)
def thresholds(n: int, p: float, alpha: float) -> tuple[int, int]:
    """(lo, hi): the two-sided exact test at level alpha (alpha/2 each tail) rejects O <= lo or O >= hi."""
    lo, hi = thresholds_of(n, [p], alpha)
    return int(lo[0]), int(hi[0])


def reject_probabilities(
    n: int, p_null: Sequence[float], p_true: Sequence[float], alpha: float
) -> torch.Tensor:  # -> [len(p_null)]
    """For each pair, the probability that the test of p_null at level alpha rejects O ~ Binomial(n, p_true)."""
    unique = sorted(set(p_null))  # a set's test is shifted both ways: each null comes twice
    lo, hi = thresholds_of(n, unique, alpha)  # [U], [U]
    index = {p: i for i, p in enumerate(unique)}
    row = torch.tensor([index[p] for p in p_null])  # [T]
    lo, hi = lo[row], hi[row]  # [T], [T]
    k = torch.arange(n + 1)
    rejects = (k <= lo[:, None]) | (k >= hi[:, None])  # [T, n + 1]
    return (binomial_pmfs(n, p_true) * rejects).sum(1)


def reject_probability(n: int, p_null: float, p_true: float, alpha: float) -> float:
    return float(reject_probabilities(n, [p_null], [p_true], alpha)[0])


# ---- cells, sets, the test ------------------------------------------------------------------------


def cells(law: dict[tuple[int, ...], float]) -> list[list[tuple[int, ...]]]:
    """The outcomes, grouped: the likeliest alone while P >= CELL_MIN (at most MAX_CELLS - 2 of them),
    the rest in one cell, and last an empty cell standing for every sequence P gives 0 (a run there
    fails the check at once; as a cell it enters the power bound: mass moved onto impossible
    sequences). Deterministic in the law."""
    order = sorted(law, key=lambda k: (-law[k], k))
    single = [[k] for k in order[: MAX_CELLS - 2] if law[k] >= CELL_MIN]
    rest = order[len(single) :]
    return single + ([rest] if rest else []) + [[]]


def cell_probs(law: dict[tuple[int, ...], float], groups: list[list[tuple[int, ...]]]) -> list[float]:
    return [sum(law[k] for k in g) for g in groups]


def sets(k: int) -> list[tuple[int, ...]]:
    """Every set of cells up to complement: the nonempty subsets of the first k - 1 cells."""
    out = []
    for mask in itertools.product((0, 1), repeat=max(k - 1, 0)):
        if any(mask):
            out.append(tuple(i for i, m in enumerate(mask) if m))
    return out


def set_level(k: int, alpha: float) -> float:
    """The level of one set's test at one look."""
    return alpha / (max(len(sets(k)), 1) * len(LOOKS))


def look_sizes(n: int) -> list[int]:
    return sorted({max(1, round(f * n)) for f in LOOKS})


def rejections(counts: Sequence[int], probs: Sequence[float], alpha: float) -> list[str]:
    """The sets whose binomial test rejects, described (empty: the counts fit P)."""
    n, k = sum(counts), len(probs)
    level = set_level(k, alpha)
    out = []
    for s in sets(k):
        a = sum(probs[i] for i in s)
        o = sum(counts[i] for i in s)
        lo, hi = thresholds(n, min(round(a, 15), 1.0), level)
        if o <= lo or o >= hi:
            out.append(f"cells {list(s)}: {o} of {n} runs, expected {n * a:.1f} (accept {lo + 1}..{hi - 1})")
    return out


def worst_power(probs: Sequence[float], n: int, alpha: float, epsilon: float = EPSILON) -> float:
    """Smallest probability that the n-run test rejects a law of the cells at TV epsilon from probs."""
    k = len(probs)
    nulls, shifted = [], []  # every set's P(A), and P(A) moved by epsilon either way
    for s in sets(k):
        a = sum(probs[i] for i in s)
        for moved in (a + epsilon, a - epsilon):
            if 0.0 <= moved <= 1.0:
                nulls.append(min(round(a, 15), 1.0))
                shifted.append(moved)
    if not shifted:
        return 1.0
    return min(1.0, float(reject_probabilities(n, nulls, shifted, set_level(k, alpha)).min()))


def power_of(
    law: dict[tuple[int, ...], float], n: int, alpha: float = ALPHA, epsilon: float = EPSILON
) -> float:
    return worst_power(cell_probs(law, cells(law)), n, alpha, epsilon)


def runs_for(
    law: dict[tuple[int, ...], float],
    alpha: float = ALPHA,
    power: float = POWER,
    epsilon: float = EPSILON,
    most: int = 4000,
) -> int:
    """The fewest runs (a multiple of 20) whose worst-case power reaches `power`, or `most`."""
    lo, hi = 20, most
    if power_of(law, hi, alpha, epsilon) < power:
        return most
    while hi - lo > 20:
        mid = (lo + hi) // 40 * 20
        lo, hi = (mid, hi) if power_of(law, mid, alpha, epsilon) < power else (lo, mid)
    return hi


def spread(probs: Sequence[float]) -> float:
    """max over sets A of P(A) (1 - P(A)): how balanced the law's hardest set is."""
    return max(((a := sum(probs[i] for i in s)) * (1 - a) for s in sets(len(probs))), default=0.0)
