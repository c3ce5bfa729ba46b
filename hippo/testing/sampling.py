"""`assert_sampling_exact`: the pipeline's sampled law against the target's exact law, with power.

The check runs the pipeline N times (seeds seed, seed+1, ...) on a fixed case and compares the
law of the m generated tokens with the target's exact joint law P, enumerated from the target's own
forward passes and processed with the logits processors `generate` applies (repetition penalty,
temperature, top-k, top-p). It fails (`LosslessViolation`):
- at once, when a run emits a sequence P gives probability 0 (a token the target cannot emit);
- when an exact binomial test on the number of runs in some set of outcomes rejects
  (`hippo.testing.power`): level `alpha` (Bonferroni over the sets and the looks at N/4, N/2, N),
  power at least `power` against every sampler whose law is at total variation `epsilon` from P.
`runs=None` picks the smallest N with that power (`power.runs_for`); a law too flat to reach it
within `max_runs` raises `VacuousCheck` before sampling (lower the temperature). The tests sample
*peaked* heads (low temperature, top-k): the tiny random models' logits are nearly flat (std 0.16),
and a flat law needs thousands of runs to see a 5% error.

The default case makes every step of speculative sampling matter: the target drafts for itself from
a pruned video (q close to, but not, p), γ = 2, and the second draft position of each round is
replaced by q's second choice (`corrupt`), so rounds accept the first token and usually reject the
second (residual draws), and sometimes accept both (bonus draws). It also fails with `VacuousCheck`
when no round accepted part of its draft (`require_partial`).
Notation: p = target, q = draft, γ = draft length, V = vocabulary size, m = new tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from hippo.errors import ConfigError
from hippo.testing import power as pw
from hippo.testing.case import Case
from hippo.testing.drafters import corrupting_plugin
from hippo.testing.greedy import make_pipeline, part_names
from hippo.testing.models import Prompt, eos_ids, pixel_unit, text_ids, tiny, tiny_adapters
from hippo.testing.reference import exact_law, warpers
from hippo.testing.report import LosslessViolation, Report, VacuousCheck

MAX_OUTCOMES = 4096
# per process: enumerated laws (float64, exact), by case and settings
_LAWS: dict[tuple, dict[tuple[int, ...], float]] = {}

#: The default settings of a law check (and of `hippo check --sampling`).
DEFAULTS: dict[str, Any] = {
    "draft": "self",
    "gamma": 2,
    "keep_ratio": 0.5,
    "corrupt": (False, True),
    "temperature": 0.01,
    "top_k": 2,
    "top_p": None,
    "repetition_penalty": None,
    "new_tokens": 4,
}

#: A second, targeted check for parts that draft or verify token trees. On the peaked default law a
#: tree's first child is almost always accepted, so the rule for its siblings hardly runs; here the
#: draft is further from p (a smaller keep ratio) and the law flatter (T = 0.03), so first children
#: are often rejected and siblings tested. Its power against an arbitrary 5% error is low (it is
#: reported); its job is the sibling rule (the planted `planted_tree_unnormalised` fails it at once).
TREE_SETTINGS: dict[str, Any] = {"keep_ratio": 0.25, "temperature": 0.03, "runs": 1200}


@attrs.define
class SamplingResult:
    runs: int = 0
    outcomes: int = 0  # sequences with positive probability
    cells: int = 0  # groups of them that the binomial tests count
    mode: float = 0.0  # P of the likeliest cell
    power: float = 0.0  # worst-case power against a law at TV `epsilon`
    epsilon: float = pw.EPSILON
    alpha: float = pw.ALPHA
    tv: float = 0.0  # total variation between the sampled cells and P's (for the report)
    rounds: int = 0
    partial_rounds: int = 0
    rejected_rounds: int = 0
    looks: list = attrs.field(factory=list)  # runs at each look taken

    def summary(self) -> str:
        return (
            f"{self.runs} runs, {self.outcomes} outcomes in {self.cells} cells (mode {self.mode:.3f}), "
            f"TV {self.tv:.4f}; detects any TV {self.epsilon:g} error with power {self.power:.3f} at level "
            f"{self.alpha:.0e}; {self.partial_rounds} of {self.rounds} rounds partially accepted"
        )


def default_adapter() -> str:
    names = tiny_adapters()
    if not names:
        raise ConfigError("no registered adapter provides a tiny model")
    return "qwen2_5_vl" if "qwen2_5_vl" in names else names[0]


def sampling_case(
    adapter: str | None = None,
    *,
    draft: str = DEFAULTS["draft"],
    gamma: int = DEFAULTS["gamma"],
    keep_ratio: float = DEFAULTS["keep_ratio"],
    new_tokens: int = DEFAULTS["new_tokens"],
    corrupt: tuple[bool, ...] | None = DEFAULTS["corrupt"],
    executor: str = "inline",
) -> Case:
    """The fixed case the law test samples: the adapter's default prompt (`Prompt.default`)."""
    adapter = adapter or default_adapter()
    model = tiny(adapter)
    unit, words = pixel_unit(model), text_ids(model)
    return Case(
        adapter=adapter,
        grid=(2, 2 * unit, 2 * unit),
        before=words[10:13],
        after=words[20:22],
        draft=draft,
        gamma=gamma,
        keep_ratio=keep_ratio,
        max_new_tokens=new_tokens,
        wrong=corrupt,
        executor=executor,
    )


def generation(
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    repetition_penalty: float | None,
    new_tokens: int,
) -> dict[str, Any]:
    """The `generate` settings of a law check; unset options are switched off explicitly (the model's
    generation_config may set them)."""
    return {
        "do_sample": True,
        "temperature": temperature,
        "top_k": top_k or 0,
        "top_p": 1.0 if top_p is None else top_p,
        "repetition_penalty": 1.0 if repetition_penalty is None else repetition_penalty,
        "max_new_tokens": new_tokens,
    }


def target_law(
    case: Case,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
) -> dict[tuple[int, ...], float]:
    """The target's exact law of the case's first `max_new_tokens` tokens (cached per process)."""
    key = (
        case.adapter,
        case.target_seed,
        case.grid,
        case.before,
        case.after,
        case.video_seed,
        case.max_new_tokens,
        temperature,
        top_k,
        top_p,
        repetition_penalty,
    )
    if key not in _LAWS:
        target = case.target
        proc = warpers(temperature, top_k, top_p, repetition_penalty)
        _LAWS[key] = exact_law(
            target, case.inputs, case.max_new_tokens, proc, set(eos_ids(target)), limit=MAX_OUTCOMES
        )
    return _LAWS[key]


def assert_sampling_exact(
    build: Callable[[Case], Any],
    *,
    adapter: str | None = None,
    draft: str = DEFAULTS["draft"],
    gamma: int = DEFAULTS["gamma"],
    keep_ratio: float = DEFAULTS["keep_ratio"],
    corrupt: tuple[bool, ...] | None = DEFAULTS["corrupt"],
    temperature: float = DEFAULTS["temperature"],
    top_k: int | None = DEFAULTS["top_k"],
    top_p: float | None = DEFAULTS["top_p"],
    repetition_penalty: float | None = DEFAULTS["repetition_penalty"],
    new_tokens: int = DEFAULTS["new_tokens"],
    executor: str = "inline",
    runs: int | None = None,
    max_runs: int = 3000,
    alpha: float = pw.ALPHA,
    epsilon: float = pw.EPSILON,
    power: float = pw.POWER,
    require_partial: bool = True,
    seed: int = 0,
    sensitivity: None = None,
    delta: float | None = None,
) -> SamplingResult:
    """Check that `build(case)`'s pipeline samples exactly the target's law (see the module docstring).

    The case is fixed (`sampling_case`): the adapter's tiny target p, drafting for itself
    (`draft="self"`) or with its tiny draft ("draft"), γ, keep ratio, draft positions replaced by
    q's second choice (`corrupt`) and the executor of a parallel schedule. Runs use seeds seed,
    seed+1, ... with do_sample=True and the given temperature, top_k, top_p, repetition_penalty and
    new_tokens. `runs=None` picks N for `power` against a total-variation error `epsilon` at level
    `alpha`; an explicit `runs` is used as is (its power is reported). `delta` is the old name of
    `alpha`; `sensitivity` (the former surprisal test's) must be None.
    Raises `LosslessViolation` with a report when the law is off, `VacuousCheck` when the check could
    prove nothing (too flat a law for `max_runs`, or no round partially accepted).
    """
    if sensitivity is not None:
        raise ConfigError(
            "assert_sampling_exact: sensitivity= is gone (the check now has a stated power against any "
            "total-variation error): pass epsilon= and power=, or runs="
        )
    if delta is not None:
        alpha = delta
    if not 0 < alpha < 1 or not 0 < epsilon < 1 or not 0 < power < 1:
        raise ConfigError(f"alpha, epsilon and power must be in (0, 1), got {alpha}, {epsilon}, {power}")
    case = sampling_case(
        adapter,
        draft=draft,
        gamma=gamma,
        keep_ratio=keep_ratio,
        new_tokens=new_tokens,
        corrupt=corrupt,
        executor=executor,
    )
    law = target_law(case, temperature, top_k, top_p, repetition_penalty)
    groups = pw.cells(law)
    probs = pw.cell_probs(law, groups)
    where = {k: i for i, g in enumerate(groups) for k in g}
    n = runs if runs is not None else pw.runs_for(law, alpha, power, epsilon, most=max_runs)
    res = SamplingResult(
        outcomes=len(law),
        cells=len(groups),
        mode=max(probs),
        power=pw.worst_power(probs, n, alpha, epsilon),
        epsilon=epsilon,
        alpha=alpha,
    )
    settings = (
        f"temperature={temperature:g}, top_k={top_k}, top_p={top_p}, repetition_penalty={repetition_penalty}"
    )
    if runs is None and res.power < power:
        raise VacuousCheck(
            f"the target's law here is too flat: {max_runs} runs (max_runs) detect a TV {epsilon:g} error "
            f"with power {res.power:.3f} only, not {power:g} ({len(law)} outcomes, mode {res.mode:.3f}, "
            f"{settings}): lower the temperature or top_k, or raise max_runs"
        )
    gen = generation(temperature, top_k, top_p, repetition_penalty, new_tokens)
    L = case.prompt.length
    counts = [0] * len(groups)
    looks = pw.look_sizes(n)
    pipe = None

    def report(summary: str, details: str = "") -> Report:
        return Report(
            check="sampling",
            summary=summary,
            case=case.short() + ", " + settings,
            parts=part_names(pipe),
            reproduce=(
                f"assert_sampling_exact(build, adapter={case.adapter!r}, draft={draft!r}, gamma={gamma}, "
                f"keep_ratio={keep_ratio}, corrupt={corrupt}, {settings}, new_tokens={new_tokens}, "
                f"executor={executor!r}, runs={n}, alpha={alpha:g}, seed={seed})"
            ),
            details=details or res.summary(),
        )

    def tv() -> float:
        m = sum(counts)
        return 0.5 * sum(abs(c / m - p) for c, p in zip(counts, probs)) if m else 0.0

    with corrupting_plugin():
        pipe, owned = make_pipeline(build, case)
        try:
            for run in range(n):
                out = pipe.generate(case.inputs, seed=seed + run, **gen)
                toks = tuple(out.sequences[0, L:].cpu().tolist())
                s = out.stats
                res.rounds += s.rounds
                res.partial_rounds += sum(
                    0 < a < g for a, g in zip(s.accepted_per_round, s.drafted_per_round)
                )
                res.rejected_rounds += sum(a < g for a, g in zip(s.accepted_per_round, s.drafted_per_round))
                res.runs = run + 1
                if toks not in where:
                    raise LosslessViolation(
                        report(
                            f"run with seed {seed + run} emitted {list(toks)}, a sequence the target gives "
                            "probability 0 (a token it cannot emit there)",
                        )
                    )
                counts[where[toks]] += 1
                if res.runs in looks:
                    res.looks.append(res.runs)
                    res.tv = tv()
                    bad = pw.rejections(counts, probs, alpha)
                    if bad:
                        expected = ", ".join(
                            f"{[list(k) for k in g[:2]]}{'...' if len(g) > 2 else ''}: {c} runs, P = {p:.4f}"
                            for g, c, p in zip(groups, counts, probs)
                        )
                        raise LosslessViolation(
                            report(
                                f"the sequences' law is off after {res.runs} runs: TV {res.tv:.4f}; "
                                f"{len(bad)} binomial test(s) reject at level {alpha:.0e}: {bad[0]}",
                                f"cells (sequences: runs, target's P): {expected}; {res.summary()}",
                            )
                        )
        finally:
            if owned:
                pipe.close()

    drafts = getattr(pipe, "draft_adapter", None) is not None
    if require_partial and drafts and not res.partial_rounds:
        raise VacuousCheck(f"no round accepted part of its draft tokens: {res.summary()}")
    return res


# ---- the suite's law checks (tests/lossless/test_sampling.py; `python -m hippo.testing.power`) ------

#: name -> settings: chain and tree, serial and parallel schedules, every adapter, top_p and the
#: repetition penalty; each on a peaked law (its temperature) so that N stays small.
LAW_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_5_vl hippo chain top_p": {
        "scheduler": "hippo",
        "temperature": 0.0075,
        "top_k": None,
        "top_p": 0.99,
    },
    "qwen3_vl serial chain top_k=3": {"adapter": "qwen3_vl", "temperature": 0.001, "top_k": 3},
    "llava_onevision hippo chain repetition_penalty": {
        "adapter": "llava_onevision",
        "scheduler": "hippo",
        "temperature": 0.002,
        "repetition_penalty": 1.3,
    },
    "video_salmonn2_plus serial tree": {
        "adapter": "video_salmonn2_plus",
        "drafter": "tree",
        "temperature": 0.002,
    },
    "qwen2_5_vl hippo tree": {"scheduler": "hippo", "drafter": "tree", "temperature": 0.005},
}


def config_law(cfg: dict[str, Any]) -> dict[tuple[int, ...], float]:
    """The exact law a LAW_CONFIGS entry is checked against."""
    opts = {**DEFAULTS, **{k: v for k, v in cfg.items() if k in DEFAULTS}}
    case = sampling_case(
        cfg.get("adapter"),
        draft=opts["draft"],
        gamma=opts["gamma"],
        keep_ratio=opts["keep_ratio"],
        new_tokens=opts["new_tokens"],
        corrupt=opts["corrupt"],
    )
    return target_law(case, opts["temperature"], opts["top_k"], opts["top_p"], opts["repetition_penalty"])


__all__ = [
    "DEFAULTS",
    "TREE_SETTINGS",
    "LAW_CONFIGS",
    "Prompt",
    "SamplingResult",
    "assert_sampling_exact",
    "config_law",
    "default_adapter",
    "sampling_case",
    "target_law",
]
