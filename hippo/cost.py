"""γ from a cost model (`gamma="auto"`): the draft length that maximises expected tokens per second.

Notation: p = target, q = draft, γ = draft length, α = probability that a draft token is accepted.

- t_verify(k): seconds of one k-token forward of p, measured once per pipeline right after p's first
  prefill (a few forwards of 1, 2, 4, ... tokens, each rolled back, so p's cache ends as it began);
  cached on the scheduler, so later calls pay nothing.
- t_draft: seconds per draft token, as observed so far in this call.
- α: the acceptance seen so far in this call, (accepted + 1) / (drafted + 2) (a uniform prior).
- A round of γ i.i.d.-accepted drafts emits E(γ) = (1 - α^(γ+1)) / (1 - α) tokens (Leviathan et
  al.). It costs γ·t_draft + t_verify(γ+1) when q and p take turns (`serial`), and
  max(γ·t_draft, t_verify(γ+1)) when q drafts while p verifies (`pearl`, `hippo`).

Any γ is exact (the verification decides what is emitted), so this only changes speed. Since γ
depends on measured times, a seeded sampling run with `gamma="auto"` is exact in law but not
reproducible sample for sample.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from hippo.interfaces import ModelSession
from hippo.types import Stats

#: The longest draft a `gamma="auto"` round asks for.
GAMMA_MAX = 16
#: γ before anything about the draft's speed is known.
GAMMA_START = 5


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a round of γ drafts emits on average when each is accepted with probability α."""
    if alpha >= 1.0 - 1e-12:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


class VerifyCurve:
    """t_verify(k) from a few measured widths: piecewise linear, extended linearly past the last."""

    def __init__(self, seconds: dict[int, float]):
        if not seconds:
            raise ValueError("a verify curve needs at least one measured width")
        self.ks = sorted(seconds)
        self.seconds = dict(seconds)

    def __call__(self, k: int) -> float:
        ks, s = self.ks, self.seconds
        if k <= ks[0]:
            return s[ks[0]]
        if len(ks) == 1:
            return s[ks[0]] * k / ks[0]
        for lo, hi in zip(ks, ks[1:]):
            if k <= hi:
                return s[lo] + (s[hi] - s[lo]) * (k - lo) / (hi - lo)
        lo, hi = ks[-2], ks[-1]
        return s[hi] + max(0.0, (s[hi] - s[lo]) / (hi - lo)) * (k - hi)


def measure_verify_curve(
    session: ModelSession,
    prefix: torch.Tensor,  # [T] the sequence the session holds a prefix of
    widths: Sequence[int] = (1, 2, 4, 8, 16),
    repeats: int = 2,
) -> VerifyCurve:
    """Time k-token forwards after the session's current length, rolling back after each.

    The tokens fed are the prefix's last token repeated (their logits are thrown away). The
    session ends at the length it began with; take it at p's prompt length, where a rollback
    restores the prompt's logits.
    """
    length = session.length
    filler = prefix[-1:].cpu()  # [1]
    seconds: dict[int, float] = {}
    for k in widths:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            session.forward(filler.repeat(k))
            best = min(best, time.perf_counter() - t0)
            session.rollback(length)
        seconds[k] = best
    return VerifyCurve(seconds)


def best_gamma(
    curve: VerifyCurve,
    alpha: float,
    t_draft: float,
    parallel: bool,
    gamma_max: int = GAMMA_MAX,
) -> int:
    """The γ in 1..gamma_max with the most expected tokens per second (the smallest on ties)."""
    best, best_rate = 1, -1.0
    for g in range(1, gamma_max + 1):
        draft, verify = g * t_draft, curve(g + 1)
        seconds = max(draft, verify) if parallel else draft + verify
        rate = expected_tokens(alpha, g) / seconds if seconds > 0 else float(g + 1)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = g, rate
    return best


class AutoGamma:
    """A scheduler's `gamma="auto"`: the curve is measured on its first call and then cached."""

    def __init__(self, parallel: bool, gamma_max: int = GAMMA_MAX):
        self.parallel, self.gamma_max = parallel, gamma_max
        self.curve: VerifyCurve | None = None

    def calibrate(self, target: ModelSession, prefix: torch.Tensor) -> None:  # prefix [T]
        """Measure t_verify once (the first call with this scheduler); later calls keep the curve."""
        if self.curve is None:
            widths = sorted({k for k in (1, 2, 4, 8) if k <= self.gamma_max} | {self.gamma_max + 1})
            self.curve = measure_verify_curve(target, prefix, widths)

    def choose(self, stats: Stats, t_draft: float | None) -> int:
        """This round's γ from the acceptance in `stats` and the draft's seconds per token."""
        if self.curve is None or t_draft is None:
            return min(GAMMA_START, self.gamma_max)
        drafted = sum(stats.drafted_per_round)
        alpha = (sum(stats.accepted_per_round) + 1) / (drafted + 2)
        return best_gamma(self.curve, alpha, t_draft, self.parallel, self.gamma_max)
