"""γ from a cost model (`gamma="auto"`): the draft length that maximises expected tokens per second,
γ = 0 (the target alone) included.

Notation: p = target, q = draft, γ = draft length, α = probability that a draft token is accepted.

- t_verify(k): seconds of one k-token forward of p, measured once per pipeline right after p's first
  prefill (a few forwards of 1, 2, 4, ... tokens, each rolled back, so p's cache ends as it began);
  cached on the scheduler, so later calls pay nothing. t_decode = t_verify(1).
- t_draft: seconds per draft token, as observed so far in this call.
- A scheduler's `costs` option fixes t_verify (and t_draft, if given) instead of measuring them:
  `scheduler="auto"` passes its cached measurements this way, and tests force the switches with it.
- p's curve is measured once, q's t_draft live: where the load on the machine changes, or the
  context grows (a long video after a calibration on a short one), the two drift apart. So p's
  forwards are timed as they happen, target-only steps and verifications alike (a round's one
  forward of k tokens, against t_verify(k)), and the median of the recent ratios rescales p's curve
  (`GammaPlan.scale`). The curve's shape is corrected too, per width k: a calibration times a few
  widths and interpolates the rest, but a CPU's matrix kernels do not cost linearly in the tokens fed
  (narration pair, 8 rows, 2-core AMD EPYC: the live forward of 6 tokens a row 0.93x the curve, of
  8 tokens 1.04x, so the curve favoured γ = 7 over γ = 5 where γ = 5 was 5% faster). So a width k
  that p's recent forwards fed is rescaled by the median of their ratios at k, and a width not fed
  lately by the pooled median (`GammaPlan.live_curve`).
- A round costs more than q's steps and p's forward: the host's work around them (the acceptance,
  each row's logits processors and bookkeeping, emitting) and q's catch-up. The engine reports each
  round's wall seconds (`GammaPlan.ran`), and what the model above did not predict is fitted per
  width k = γ + 1 as a + b·k (`RoundOverhead`) and charged to every γ. Measured on the narration
  pair at 8 rows with `min_new_tokens` (a logits processor every row and position): 3.8 ms at γ = 5
  and 5.5 ms at γ = 7 on top of the model's 22-27 ms, which made γ = 7 look best where γ = 5 was
  4% faster.
- α: the acceptance seen so far in this call, recent rounds weighing more, and a prior that fades
  like an old round (`Acceptance`): 1/2, or the α of the pipeline's earlier jobs where the `auto`
  scheduler carries it (`AutoGamma.prior`). A round checks its accepted tokens and, if it rejected,
  one more: the tokens after a rejection were never checked, so they are not counted as failures.
- A round of γ i.i.d.-accepted drafts emits E(γ) = (1 - α^(γ+1)) / (1 - α) tokens (Leviathan et
  al.). It costs γ·t_draft + t_verify(γ+1) when q and p take turns (`serial`, or a parallel schedule
  whose executor runs them one after the other), and max(γ·t_draft, t_verify(γ+1)) when q drafts
  while p verifies (`pearl`, `hippo` beside a draft thread or process).
- A batch of B rows (`hippo.engine`) takes one γ per round for all its live rows: the one of the
  most expected tokens per second of the batch, Σ_rows E(α_r, γ) / (γ·t_draft(B) + t_verify(B, γ+1)),
  each row's α from its own rounds. p's forward is compute-bound on a CPU, so t_verify(B, k) is
  measured on the batch the first time B rows are seen, or interpolated in B between sizes measured
  (`AutoGamma.batch_curve`), and t_draft(B), one batched step of q, is timed live.
- γ = 0 emits one token per t_decode. When no γ >= 1 is expected to beat it, the job decodes with
  the target alone for a few steps, then drafts one probe round to see whether the draft agrees
  better now; each probe that still loses doubles the wait (`BACKOFF_START` .. `BACKOFF_MAX` steps).
  A job whose α is carried from the pipeline's earlier jobs (`auto`) also starts from half the wait
  the last of them ended with, not from `BACKOFF_START`: a draft that was losing job after job is
  not probed log2(answer length) times in every job again. Measured with an untrained draft on the
  narration pair (answers of 161 and 81 tokens, 2-core AMD EPYC, AVX2): 2 and 1 drafting rounds
  per answer instead of 6 and 5, and the draft's work (prefill, pruning, drafting) 2.1% of the
  target alone's time instead of 4.4%.

Any γ is exact (the verification decides what is emitted, and a target-only step is a plain
decoding step), so this only changes speed. Since γ depends on measured times, a seeded sampling
run with `gamma="auto"` is exact in law but not reproducible sample for sample.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from hippo.errors import ConfigError
from hippo.types import Stats

#: The longest draft a `gamma="auto"` round asks for.
GAMMA_MAX = 16
#: γ before anything about the draft's speed is known, and of a probe round after target-only steps.
GAMMA_START = 5
#: Each round's weight in α shrinks by this factor with every later round (about the last 5 rounds count).
DECAY = 0.8
#: α before any round is seen, as strong as PRIOR_CHECKED checked tokens
PRIOR_ALPHA = 0.5
PRIOR_CHECKED = 2.0


def calibration_widths(gamma_max: int) -> list[int]:
    """The widths k a calibration times t_verify(k) at: 1, 2, 4, 8 up to γ_max, and γ_max + 1."""
    return sorted({k for k in (1, 2, 4, 8) if k <= gamma_max} | {gamma_max + 1})


#: Target-only steps after drafting first loses; doubled after each probe that still loses, up to the max.
BACKOFF_START = 4
BACKOFF_MAX = 256
#: p's recent forwards (target-only steps, verifications) whose median ratio to the calibrated curve
#: rescales it (`GammaPlan.scale`)
LIVE_STEPS = 16


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


def time_widths(
    forward: Callable[[int], Any], restore: Callable[[], Any], widths: Sequence[int], repeats: int = 3
) -> VerifyCurve:
    """A verify curve from timed forwards: `forward(k)` feeds k tokens (per row), `restore()` undoes it.

    Each width keeps its fastest of `repeats` passes over all widths, so a burst of load elsewhere on
    the machine spoils one pass of every width rather than all of one width's.
    """
    seconds = dict.fromkeys(widths, float("inf"))
    for _ in range(repeats):
        for k in widths:
            t0 = time.perf_counter()
            forward(k)
            seconds[k] = min(seconds[k], time.perf_counter() - t0)
            restore()
    return VerifyCurve(seconds)


class Timed(Protocol):
    """What a calibration times: k-token forwards after the first `length` tokens, each rolled back
    (a `hippo.interfaces.ModelSession`; the cost model needs nothing else of it)."""

    length: int

    def forward(self, tokens: torch.Tensor) -> torch.Tensor: ...  # tokens [k] -> logits [k, V]

    def rollback(self, length: int) -> None: ...


def measure_verify_curve(
    session: Timed,
    prefix: torch.Tensor,  # [T] the sequence the session holds a prefix of
    widths: Sequence[int] = (1, 2, 4, 8, 16),
    repeats: int = 3,
) -> VerifyCurve:
    """Time k-token forwards after the session's current length, rolling back after each (`time_widths`).

    The tokens fed are the prefix's last token repeated (their logits are thrown away). The session
    ends at the length it began with; take it at p's prompt length, where a rollback restores the
    prompt's logits.
    """
    length = session.length
    filler = prefix[-1:].cpu()  # [1]
    return time_widths(
        lambda k: session.forward(filler.repeat(k)), lambda: session.rollback(length), widths, repeats
    )


def round_seconds(
    curve: VerifyCurve,
    t_draft: float,
    gamma: int,
    parallel: bool,
    overhead: Callable[[int], float] | None = None,
) -> float:
    """Seconds of one round: γ drafts and their verification; γ = 0, one step of the target alone;
    plus `overhead(γ + 1)`, the host's work around them, where given (`RoundOverhead`)."""
    extra = 0.0 if overhead is None else overhead(gamma + 1)
    if gamma == 0:
        return curve(1) + extra
    draft, verify = gamma * t_draft, curve(gamma + 1)
    return (max(draft, verify) if parallel else draft + verify) + extra


def rates(
    curve: VerifyCurve,
    alpha: float | Sequence[float],
    t_draft: float,
    parallel: bool,
    gamma_max: int = GAMMA_MAX,
    overhead: Callable[[int], float] | None = None,
) -> list[float]:
    """Expected tokens per second of each γ in 0..gamma_max (index γ; 0 = the target alone).

    `alpha`: one job's α, or one α per row of a batch whose rows draft γ tokens each in the same
    round: then the batch's Σ_rows E(α_r, γ) over the round's seconds (`curve`: the batch's t_verify,
    `t_draft`: one batched draft step)."""
    alphas = [alpha] if isinstance(alpha, int | float) else list(alpha)
    out = []
    for g in range(gamma_max + 1):
        seconds = round_seconds(curve, t_draft, g, parallel, overhead)
        tokens = sum(expected_tokens(a, g) for a in alphas)
        out.append(tokens / seconds if seconds > 0 else float(len(alphas) * (g + 1)))
    return out


def best_gamma(
    curve: VerifyCurve,
    alpha: float,
    t_draft: float,
    parallel: bool,
    gamma_max: int = GAMMA_MAX,
) -> int:
    """The γ in 1..gamma_max with the most expected tokens per second (the smallest on ties)."""
    return _best(rates(curve, alpha, t_draft, parallel, gamma_max))


def _best(per_gamma: list[float]) -> int:  # the γ >= 1 of the highest rate, the smallest on ties
    best = 1
    for g in range(2, len(per_gamma)):
        if per_gamma[g] > per_gamma[best] * (1 + 1e-9):
            best = g
    return best


def fixed_costs(costs: dict) -> tuple[VerifyCurve, float | None]:
    """A scheduler's `costs` option, {"verify": {k: seconds}, "draft": seconds per draft token}
    ("draft" optional: measured during the call if left out), as (t_verify curve, t_draft)."""
    try:
        verify = {int(k): float(v) for k, v in costs["verify"].items()}
        draft = costs.get("draft")
        draft = None if draft is None else float(draft)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(
            f'costs must be {{"verify": {{k: seconds}}, "draft": seconds}}, got {costs!r} ({exc})'
        ) from None
    if not verify or min(verify) < 1 or min(verify.values()) <= 0 or (draft is not None and draft <= 0):
        raise ConfigError(f"costs need widths k >= 1 and positive seconds, got {costs!r}")
    return VerifyCurve(verify), draft


def costs_option(instance: Any, attribute: Any, value: dict | None) -> None:
    """attrs validator of a scheduler's `costs` option (None: measure them)."""
    if value is not None:
        fixed_costs(value)


class Acceptance:
    """α = accepted / checked over the rounds seen so far, each round's counts shrinking by `DECAY` per
    later round. A round checked its accepted tokens plus the rejected one, if any. The prior
    (`PRIOR_ALPHA` of `PRIOR_CHECKED` tokens: 1 accepted of 2 checked) shrinks like an old round: a draft that is never right drives α
    towards 0 (0.08 after 5 rounds), not towards a floor set by the prior."""

    def __init__(self, accepted: float = PRIOR_ALPHA * PRIOR_CHECKED, checked: float = PRIOR_CHECKED):
        self.accepted, self.checked = accepted, checked
        self.seen = 0  # rounds of the job's stats already counted

    @classmethod
    def starting_at(cls, alpha: float) -> Acceptance:
        """A prior of α = `alpha`, as strong as the default one (`PRIOR_CHECKED` checked tokens)."""
        return cls(PRIOR_CHECKED * alpha, PRIOR_CHECKED)

    def update(self, stats: Stats) -> float:
        rounds = zip(stats.accepted_per_round[self.seen :], stats.rejected_per_round[self.seen :])
        for accepted, rejected in rounds:
            self.accepted = self.accepted * DECAY + accepted
            self.checked = self.checked * DECAY + accepted + int(rejected)
        self.seen = len(stats.accepted_per_round)
        return self.alpha

    @property
    def alpha(self) -> float:
        return self.accepted / self.checked


class RoundOverhead:
    """The seconds of a round beyond the cost model's γ·t_draft + t_verify(γ + 1) (or its parallel
    max): what the engine measured (`GammaPlan.ran`) minus what the model predicted, over the last
    `LIVE_STEPS` rounds, fitted as a + b·k in the width k = γ + 1 through each width's median (a, b
    >= 0). Nothing is charged until two widths were seen: one width's overhead says nothing of how
    it grows with k, and taken as a constant it would send the next round to the longest γ."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []  # (k, measured - predicted seconds)

    def add(self, k: int, seconds: float) -> None:
        self.seen = [*self.seen[1 - LIVE_STEPS :], (k, seconds)]

    def fit(self) -> Callable[[int], float] | None:
        """overhead(k), or None before rounds of two widths were measured."""
        by_k: dict[int, list[float]] = {}
        for k, extra in self.seen:
            by_k.setdefault(k, []).append(extra)
        if len(by_k) < 2:
            return None
        points = [(k, statistics.median(v)) for k, v in by_k.items()]
        mk = statistics.fmean(k for k, _ in points)
        my = statistics.fmean(y for _, y in points)
        b = max(0.0, sum((k - mk) * (y - my) for k, y in points) / sum((k - mk) ** 2 for k, _ in points))
        a = max(0.0, my - b * mk)
        return lambda k: a + b * k


class AutoGamma:
    """A scheduler's `gamma="auto"`: the verify curve, measured on its first call and then kept (or
    given by `costs`), t_verify(B, k) of each batch size B seen (`batch_curve`), and a `GammaPlan`
    per job or batch."""

    def __init__(self, parallel: bool, gamma_max: int = GAMMA_MAX, costs: dict | None = None):
        self.parallel, self.gamma_max = parallel, gamma_max
        self.curve: VerifyCurve | None = None
        self.t_draft: float | None = None  # fixed seconds per draft token (None: measured per call)
        self.batch_curves: dict[int, VerifyCurve] = {}  # B -> t_verify(B, k), measured on batches
        #: α a new plan (and each row of a batch's) starts from unless the job names its own
        #: (`DecodeJob.alpha_prior`: `auto` sets the α of its pipeline's earlier jobs there)
        self.prior = PRIOR_ALPHA
        #: the back-off the last booked plan (`GammaPlan.book`) ended with: a plan that starts from a
        #: carried α starts its back-off at half of it (`BACKOFF_START` where drafting paid at its end)
        self.carried_backoff = BACKOFF_START
        if costs is not None:
            self.curve, self.t_draft = fixed_costs(costs)

    @property
    def widths(self) -> list[int]:
        """The widths k a calibration times (`calibration_widths`)."""
        return calibration_widths(self.gamma_max)

    def calibrate(self, target: Timed, prefix: torch.Tensor) -> None:  # prefix [T]
        """Measure t_verify once (the first call with this scheduler); later calls keep the curve."""
        if self.curve is None:
            self.curve = measure_verify_curve(target, prefix, self.widths)

    def batch_curve(self, rows: int, measure: Callable[[Sequence[int]], VerifyCurve]) -> VerifyCurve:
        """t_verify(B, k) of a k-token forward of each of B = `rows` rows. p's forward is compute-bound
        on a CPU, so this is not one row's t_verify(k): it is measured by `measure(widths)` on the
        batch the first time B is seen and kept, unless B lies between two sizes already known (one
        row's own curve counts as B = 1): then it is interpolated linearly in B, as the cost of B·k
        tokens is (measured for the narration pair at B = 2, 4, 6 within 1-15% of the line between
        1 and 8), so a batch whose rows finish one by one measures nothing while it shrinks. Where
        `costs` fixed the whole model (t_draft too), the fixed curve serves every B."""
        if self.curve is not None and (rows == 1 or self.t_draft is not None):
            return self.curve  # one row's own curve, or the whole model fixed by `costs`
        if rows == 1:  # measured once, as `calibrate` measures it
            self.curve = measure(self.widths)
            return self.curve
        if rows in self.batch_curves:
            return self.batch_curves[rows]
        known = {1: self.curve, **self.batch_curves} if self.curve is not None else self.batch_curves
        below, above = [b for b in known if b < rows], [b for b in known if b > rows]
        if not below or not above:
            self.batch_curves[rows] = measure(self.widths)
            return self.batch_curves[rows]
        lo, hi = max(below), min(above)
        share = (rows - lo) / (hi - lo)
        return VerifyCurve({k: known[lo](k) + share * (known[hi](k) - known[lo](k)) for k in self.widths})

    def plan(self, parallel: bool | None = None, prior: float | None = None) -> GammaPlan:
        """A new job's (or batch's) plan; `parallel`: whether its draft works while the target does
        (default: the scheduler's kind); `prior`: the α it starts from (default `self.prior`, 1/2;
        a job's `alpha_prior` where a scheduler that knows better, `auto`, set it). A plan given a
        `prior` also starts its back-off at half of `carried_backoff` (the module doc)."""
        return GammaPlan(self, self.parallel if parallel is None else parallel, prior)


class GammaPlan:
    """One job's γ round by round, γ = 0 included (see the module doc), and a record of its choices.

    A batch's plan picks one γ per round for all its live rows (`next` with one `Stats` per row)."""

    def __init__(self, auto: AutoGamma, parallel: bool, prior: float | None = None):
        self.auto, self.parallel = auto, parallel
        self.prior = auto.prior if prior is None else prior
        self.acceptance = Acceptance.starting_at(self.prior)
        self.row_acceptance: dict[int, Acceptance] = {}  # a batch's rows, by id of their Stats
        self.idle = 0  # target-only steps left before the next probe round
        self.probe_due = False
        carried = auto.carried_backoff // 2 if prior is not None else BACKOFF_START
        self.backoff = self.backoff_start = min(max(BACKOFF_START, carried), BACKOFF_MAX)
        self.target_steps = self.target_runs = self.probes = 0
        self.last: dict = {}  # the last decision's inputs and predicted tokens/s
        #: p's last LIVE_STEPS forwards of a round: (k, measured seconds over the curve's t_verify(k))
        self.live_ratios: list[tuple[int, float]] = []
        self.overhead = RoundOverhead()  # the rounds' seconds beyond the model's (`ran`)
        self._predicted: tuple[int, float] | None = None  # the last round's (k, model seconds)
        #: p's (seconds, forwards, tokens fed, curve) before a round
        self._mark: tuple[float, int, int, VerifyCurve] | None = None

    def next(
        self,
        stats: Stats | Sequence[Stats],
        t_draft: float | None,
        target: Any = None,
        curve: VerifyCurve | None = None,
    ) -> int:
        """γ for the next round (0: one step of the target alone), from `stats`' rounds so far and
        the draft's measured seconds per token (None before the first). `target` (p's session, with
        `seconds_decode` and `forwards`) lets the plan time its target-only steps (`scale`).

        A batch passes one `Stats` per live row (each row's α from its own rounds), its batched
        draft step's seconds as `t_draft` and its own t_verify(B, k) as `curve` (default: the
        scheduler's); the γ chosen maximises the batch's expected tokens per second (`rates`)."""
        auto = self.auto
        curve = auto.curve if curve is None else curve
        self._observe(target)
        self._predicted = None
        t_draft = auto.t_draft if auto.t_draft is not None else t_draft
        if curve is None or t_draft is None:
            if self.idle > 0:
                self.idle -= 1
                return self._chose(0, target, curve)
            return min(GAMMA_START, auto.gamma_max)
        live = self.live_curve(curve)  # p's curve as its recent forwards ran, against q's live t_draft
        if self.idle > 0:
            self.idle -= 1
            return self._chose(0, target, curve, live, t_draft)
        alpha = self._alpha(stats)
        overhead = self.overhead.fit() if auto.t_draft is None else None
        per_gamma = rates(live, alpha, t_draft, self.parallel, auto.gamma_max, overhead)
        best = _best(per_gamma)
        self.last = {
            "alpha": alpha,
            "t_decode": live(1),
            "t_draft": t_draft,
            "round_overhead": overhead(best + 1) if overhead is not None else 0.0,
            "parallel": self.parallel,
            "tokens_per_second": {"target alone": per_gamma[0], f"draft γ={best}": per_gamma[best]},
        }
        if self.probe_due:  # the wait is over: draft one round to measure the acceptance again
            self.probe_due = False
            self.probes += 1
            return self._chose(max(best, min(GAMMA_START, auto.gamma_max)), target, curve, live, t_draft)
        if per_gamma[best] >= per_gamma[0]:
            self.backoff = BACKOFF_START
            return self._chose(best, target, curve, live, t_draft)
        self.target_runs += 1  # drafting loses: the target alone for `backoff` steps, then a probe
        self.idle, self.probe_due = self.backoff - 1, True
        self.backoff = min(2 * self.backoff, BACKOFF_MAX)
        return self._chose(0, target, curve, live, t_draft)

    def _alpha(self, stats: Stats | Sequence[Stats]) -> float | list[float]:
        if isinstance(stats, Stats):
            return self.acceptance.update(stats)
        rows = self.row_acceptance
        return [rows.setdefault(id(s), Acceptance.starting_at(self.prior)).update(s) for s in stats]

    def _chose(
        self,
        gamma: int,
        target: Any,
        curve: VerifyCurve | None,
        live: VerifyCurve | None = None,
        t_draft: float | None = None,
    ) -> int:
        self.last["gamma"] = gamma
        if live is not None and t_draft is not None and self.auto.t_draft is None:
            self._predicted = (gamma + 1, round_seconds(live, t_draft, gamma, self.parallel))
        if gamma == 0:
            self.target_steps += 1
        if target is not None and curve is not None:
            tokens = getattr(target, "tokens_forwarded", 0)
            self._mark = (target.seconds_decode, target.forwards, tokens, curve)
        return gamma

    def _observe(self, target: Any) -> None:
        """Book the seconds of p's forward in the round just taken, against the curve's t_verify(k):
        a round of one forward only, of k tokens (the session's `tokens_forwarded`; a session that
        does not count them has its target-only steps booked, k = 1, and no verification)."""
        if self._mark is not None and target is not None:
            before, forwards, tokens, curve = self._mark
            seconds, forwards = target.seconds_decode - before, target.forwards - forwards
            k = getattr(target, "tokens_forwarded", 0) - tokens
            if k < 1 and self.last.get("gamma") == 0:
                k = 1
            if forwards == 1 and k >= 1 and seconds > 0:
                self.live_ratios = [*self.live_ratios[1 - LIVE_STEPS :], (k, seconds / curve(k))]
        self._mark = None

    def ran(self, seconds: float, gamma: int) -> None:
        """The engine's wall seconds of the round just taken (after its γ was chosen) of `gamma`
        drafts a row: what the model did not predict is the round's overhead (`RoundOverhead`)."""
        if self._predicted is not None and self._predicted[0] == gamma + 1 and seconds > 0:
            self.overhead.add(gamma + 1, seconds - self._predicted[1])
        self._predicted = None

    @property
    def scale(self) -> float:
        """p's live forward time over its calibrated curve: the median of the recent rounds' ratios
        (target-only steps and verifications), so that p's calibrated curve and q's live t_draft
        compare under the same load and context (1 where t_draft is fixed too: `costs` then is the
        whole model)."""
        if not self.live_ratios or self.auto.t_draft is not None:
            return 1.0
        return statistics.median(r for _, r in self.live_ratios)

    def live_curve(self, curve: VerifyCurve) -> VerifyCurve:
        """`curve` at p's live pace: each width k that p's recent forwards fed times the median of
        their ratios at k, every other width times `scale` (the module doc). The curve itself where
        t_draft is fixed too (`costs`: then it is the whole model)."""
        if not self.live_ratios or self.auto.t_draft is not None:
            return curve
        fed: dict[int, list[float]] = {}
        for k, r in self.live_ratios:
            fed.setdefault(k, []).append(r)
        scale = self.scale
        widths = range(1, max(self.auto.gamma_max + 1, *curve.ks) + 1)
        return VerifyCurve({k: curve(k) * (statistics.median(fed[k]) if k in fed else scale) for k in widths})

    def book(self, stats: Stats) -> None:
        """Put the job's target-only steps and the plan's record on its stats, and leave its back-off
        to the next plan (`AutoGamma.carried_backoff`)."""
        stats.target_steps = self.target_steps
        stats.plan["gamma"] = self.record()
        self.auto.carried_backoff = self.backoff

    def record(self) -> dict:
        """What the plan chose and why (for `Stats.plan`)."""
        return {
            "target_steps": self.target_steps,
            "probes": self.probes,
            "target_runs": self.target_runs,
            "backoff_start": self.backoff_start,
            "scale": self.scale,
            **self.last,
        }
