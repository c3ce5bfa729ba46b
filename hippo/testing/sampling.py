"""`assert_sampling_exact`: the pipeline's sampled law against the target's exact law, with power.

The check runs the pipeline N times (seeds seed, seed+1, ...) on a fixed case and compares the
law of the m generated tokens with the target's exact joint law P, enumerated from the target's own
forward passes and processed with the logits processors `generate` applies (repetition penalty,
temperature, top-k, top-p). It fails (`LosslessViolation`):
- at once, when a run emits a sequence P gives probability 0 (a token the target cannot emit);
- when an exact binomial test on the number of runs in some set of outcomes rejects
  (`hippo.testing.power`): level `alpha` (Bonferroni over the sets and the looks at N/10, 3N/10, N),
  power at least `power` against every sampler whose law is at total variation `epsilon` from P.
`runs=None` picks the smallest N with that power (`power.runs_for`); a law too flat to reach it
within `max_runs` raises `VacuousCheck` before sampling (lower the temperature). The tests sample
*peaked* heads (low temperature, top-k): the tiny random models' logits are nearly flat (std 0.16),
and a flat law needs thousands of runs to see a 5% error. But not too peaked: the likeliest sequence
must hold at most MAX_MODE = 0.9 of the law (`VacuousCheck` otherwise), so that a pipeline that never
samples (greedy decoding under do_sample=True) is at TV >= 0.1 and fails. Which planted bugs each
path's check catches, and at which look: `python -m hippo.testing.matrix`.

The default case makes every step of speculative sampling matter: the target drafts for itself from
a pruned video (q close to, but not, p), γ = 2, and the second draft position of each round is
replaced by q's second choice (`corrupt`), so rounds accept the first token and usually reject the
second (residual draws), and sometimes accept both (bonus draws). It also fails with `VacuousCheck`
when no drafting was accepted in part (`require_partial`): some of its tokens accepted and some not,
in one round or across the chunks `pearl` and `hippo` verify it in (`reference.partial_drafts`).
`LawCheck` is the check itself, for tests that sample another way. The stock temperatures are
checkable on Qwen2.5-VL's tiny target; on another backbone `temperature=None` (the default) runs at the
adapter's calibrated one (`hippo.testing.calibration`).
Notation: p = target, q = draft, γ = draft length, V = vocabulary size, m = new tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from hippo.errors import ConfigError
from hippo.testing import power as pw
from hippo.testing.case import DRAFTING_PAYS, Case
from hippo.testing.drafters import corrupting_plugin
from hippo.testing.greedy import make_pipeline, part_names
from hippo.testing.models import Prompt, eos_ids, pixel_unit, special_ids, text_ids, tiny, tiny_adapters
from hippo.testing.prefill import shared_prefill
from hippo.testing.reference import exact_law, partial_drafts, reference, warpers
from hippo.testing.report import LosslessViolation, Report, VacuousCheck

MAX_OUTCOMES = 4096
#: The most a law check's likeliest sequence may hold of the target's law. A pipeline that decodes
#: greedily while asked to sample emits that one sequence every run: it is at total variation
#: 1 - P(mode) from the target's law, so on a law with P(mode) <= 0.9 it is at least 2 x EPSILON away
#: and every check with the stated power sees it (`planted_greedy_collapse`). `LawCheck.plan` refuses a
#: more peaked law (`VacuousCheck`).
MAX_MODE = 0.9
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

#: A second, targeted check for parts that draft or verify token trees. On the default law a tree's
#: first child is almost always accepted, so the rule for its siblings hardly runs; here the draft is
#: flatter than p ("flat": the target with its logits halved) and the law is cut to three tokens per
#: position (top_k 3), so first children are often rejected and siblings tested, on a law still
#: peaked enough for a stated power (`python -m hippo.testing.sampling` prints it; the planted
#: `planted_tree_unnormalised` and `planted_residual_from_p` fail it).
TREE_SETTINGS: dict[str, Any] = {"draft": "flat", "keep_ratio": 0.25, "temperature": 0.0098, "top_k": 3}

#: The tree drafter's shape in the tree law checks (`hippo check`'s tree stage, the static-tree
#: configuration): two children at the root, a chain below each. With a draft flatter than p
#: (TREE_SETTINGS' "flat" draft, `models.flat_draft`) first children are often rejected, so both
#: the siblings' rule and the residual after the last sibling run on most rounds; a wide root that
#: holds all of p's top-k tokens never reaches that residual.
SIBLING_TREE: tuple[tuple[int, ...], ...] = ((0, 0, 0), (1, 0))


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
    #: draftings accepted in part (`reference.partial_drafts`: some of its tokens accepted and some
    #: not, in one round or across the chunks a parallel schedule verifies it in)
    partial_rounds: int = 0
    rejected_rounds: int = 0
    looks: list = attrs.field(factory=list)  # runs at each look taken
    planned: int = 0  # N: the runs the check plans (it stops earlier when it fails)

    def summary(self) -> str:
        return (
            f"{self.runs} runs, {self.outcomes} outcomes in {self.cells} cells (mode {self.mode:.3f}), "
            f"TV {self.tv:.4f}; detects any TV {self.epsilon:g} error with power {self.power:.3f} at level "
            f"{self.alpha:.0e}; {self.partial_rounds} draftings accepted in part over {self.rounds} rounds"
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
    key = (*_law_key(case, top_k, top_p, repetition_penalty), temperature)
    if key not in _LAWS:
        target = case.target
        proc = warpers(temperature, top_k, top_p, repetition_penalty)
        _LAWS[key] = exact_law(
            target, case.inputs, case.max_new_tokens, proc, set(eos_ids(target)), limit=MAX_OUTCOMES
        )
    return _LAWS[key]


def _law_key(case: Case, top_k: int | None, top_p: float | None, repetition_penalty: float | None) -> tuple:
    return (
        case.adapter,
        case.target_seed,
        case.grid,
        case.before,
        case.after,
        case.video_seed,
        case.max_new_tokens,
        top_k,
        top_p,
        repetition_penalty,
    )


def case_calibration(
    case: Case,
    stock: float = DEFAULTS["temperature"],
    top_k: int | None = DEFAULTS["top_k"],
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    **bounds: Any,
) -> Any:
    """The case's calibrated temperature (`hippo.testing.calibration`): `stock` when the target's law
    there is checkable, else the checkable one with the fewest runs (cached per process). `bounds`:
    max_runs, max_mode, alpha, epsilon, power. Returns a `calibration.Calibration`."""
    from hippo.testing.calibration import calibrated, score_tree

    def tree() -> Any:
        return score_tree(case.target, case.inputs, case.max_new_tokens, top_k, repetition_penalty)

    what = f"the law on {case.adapter}'s tiny target"
    return calibrated(
        _law_key(case, top_k, top_p, repetition_penalty), tree, stock, top_k, top_p, what, **bounds
    )


def assert_sampling_exact(
    build: Callable[[Case], Any],
    *,
    adapter: str | None = None,
    draft: str = DEFAULTS["draft"],
    gamma: int = DEFAULTS["gamma"],
    keep_ratio: float = DEFAULTS["keep_ratio"],
    corrupt: tuple[bool, ...] | None = DEFAULTS["corrupt"],
    temperature: float | None = None,
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
    require_power: bool = True,
    max_mode: float = MAX_MODE,
) -> SamplingResult:
    """Check that `build(case)`'s pipeline samples exactly the target's law (see the module docstring).

    The case is fixed (`sampling_case`): the adapter's tiny target p, drafting for itself
    (`draft="self"`) or with its tiny draft ("draft"), γ, keep ratio, draft positions replaced by
    q's second choice (`corrupt`) and the executor of a parallel schedule. Runs use seeds seed,
    seed+1, ... with do_sample=True and the given temperature, top_k, top_p, repetition_penalty and
    new_tokens; `temperature=None` is the adapter's calibrated one (`case_calibration`: DEFAULTS'
    T = 0.01 where its law is checkable, as on Qwen2.5-VL, else the checkable T with the fewest runs). `runs=None` picks N for `power` against a total-variation error `epsilon` at level
    `alpha`; an explicit `runs` must reach that power too (`VacuousCheck` otherwise), unless
    `require_power=False` (a smoke run: its power is only reported). The target's law must give its
    likeliest sequence at most `max_mode` (`MAX_MODE`: a greedy collapse is then visible). `delta` is
    the old name of `alpha`; `sensitivity` (the former surprisal test's) must be None.
    Raises `LosslessViolation` with a report when the law is off (at the first look that rejects),
    `VacuousCheck` when the check could prove nothing (too flat a law for `max_runs`, too few `runs`,
    too peaked a law, or no drafting accepted in part).
    """
    if sensitivity is not None:
        raise ConfigError(
            "assert_sampling_exact: sensitivity= is gone (the check now has a stated power against any "
            "total-variation error): pass epsilon= and power=, or runs="
        )
    if delta is not None:
        alpha = delta
    case = sampling_case(
        adapter,
        draft=draft,
        gamma=gamma,
        keep_ratio=keep_ratio,
        new_tokens=new_tokens,
        corrupt=corrupt,
        executor=executor,
    )
    if temperature is None:
        bounds = {
            "max_runs": max_runs,
            "max_mode": max_mode,
            "alpha": alpha,
            "epsilon": epsilon,
            "power": power,
        }
        stock = DEFAULTS["temperature"]
        temperature = case_calibration(case, stock, top_k, top_p, repetition_penalty, **bounds).temperature
    law = target_law(case, temperature, top_k, top_p, repetition_penalty)
    settings = (
        f"temperature={temperature:g}, top_k={top_k}, top_p={top_p}, repetition_penalty={repetition_penalty}"
    )
    check = LawCheck.plan(
        law,
        runs=runs,
        max_runs=max_runs,
        alpha=alpha,
        epsilon=epsilon,
        power=power,
        settings=settings,
        require_power=require_power,
        max_mode=max_mode,
    )
    res, n = check.result, check.runs
    gen = generation(temperature, top_k, top_p, repetition_penalty, new_tokens)
    L = case.prompt.length
    pipe = None

    def report(summary: str, details: str = "") -> Report:
        return Report(
            check="sampling",
            summary=summary,
            case=case.short() + ", " + settings,
            parts=part_names(pipe),
            reproduce=(
                f"assert_sampling_exact(build, adapter={case.adapter!r}, draft={draft!r}, gamma={gamma!r}, "
                f"keep_ratio={keep_ratio}, corrupt={corrupt}, {settings}, new_tokens={new_tokens}, "
                f"executor={executor!r}, runs={n}, alpha={alpha:g}, seed={seed})"
            ),
            details=details or res.summary(),
        )

    with corrupting_plugin():
        pipe, owned = make_pipeline(build, case)
        # asked before the check closes the pipeline (close() drops its adapters)
        drafts = getattr(pipe, "draft_adapter", None) is not None
        try:
            # one prefill for the N runs, and their forwards replayed by history while this thread
            # alone drives the sessions (`hippo.testing.prefill`): every draw still runs in every run
            with shared_prefill(pipe, replay=True):
                for run in range(n):
                    out = pipe.generate(case.inputs, seed=seed + run, **gen)
                    failure = check.add(out.sequences[0, L:].cpu().tolist(), out.stats)
                    if failure is not None:
                        raise LosslessViolation(
                            report(f"seeds {seed}..{seed + run}: {failure}", check.details()), res
                        )
        finally:
            if owned:
                pipe.close()
    if require_partial:
        check.require_partial(drafts)
    return res


@attrs.define
class LawCheck:
    """The binomial tests of one law check (`hippo.testing.power`), fed one run at a time.

    `assert_sampling_exact` drives it for `pipeline.generate` on its fixed case; a test that samples
    another way (a conversation's turn, ...) plans one on the target's exact law of that prompt,
    `add`s each run's tokens and stats, and fails with the message `add` returns. The level, the
    looks at N/10, 3N/10, N and the power are those of `assert_sampling_exact`.
    """

    law: dict[tuple[int, ...], float]
    runs: int
    result: SamplingResult
    groups: list[list[tuple[int, ...]]]
    probs: list[float]
    counts: list[int]
    where: dict[tuple[int, ...], int]

    @classmethod
    def plan(
        cls,
        law: dict[tuple[int, ...], float],
        *,
        runs: int | None = None,
        max_runs: int = 3000,
        alpha: float = pw.ALPHA,
        epsilon: float = pw.EPSILON,
        power: float = pw.POWER,
        settings: str = "",
        require_power: bool = True,
        max_mode: float = MAX_MODE,
    ) -> LawCheck:
        """The check of `law`: `runs` runs (None: the fewest with `power` against a TV `epsilon` error
        at level `alpha`). `VacuousCheck` before any run when `max_runs`, or the explicit `runs`, do not
        reach that power (`require_power=False`: an explicit `runs` is taken as is, its power only
        reported), or when the law's likeliest sequence holds more than `max_mode` of it (a pipeline
        that never samples would pass)."""
        if not 0 < alpha < 1 or not 0 < epsilon < 1 or not 0 < power < 1:
            raise ConfigError(f"alpha, epsilon and power must be in (0, 1), got {alpha}, {epsilon}, {power}")
        groups = pw.cells(law)
        probs = pw.cell_probs(law, groups)
        n = runs if runs is not None else pw.runs_for(law, alpha, power, epsilon, most=max_runs)
        res = SamplingResult(
            outcomes=len(law),
            cells=len(groups),
            mode=max(probs),
            power=pw.worst_power(probs, n, alpha, epsilon),
            epsilon=epsilon,
            alpha=alpha,
            planned=n,
        )
        top = max(law.values())
        if top > max_mode:
            raise VacuousCheck(
                f"the target's law here is too peaked: its likeliest sequence holds {top:.3f} of it, more "
                f"than max_mode = {max_mode:g}, so a pipeline that never samples (greedy decoding under "
                f"do_sample=True) is only TV {1 - top:.3f} away ({len(law)} outcomes"
                f"{', ' + settings if settings else ''}): raise the temperature or top_k"
            )
        if runs is not None and res.power < power and require_power:
            raise VacuousCheck(
                f"runs={runs} detect a TV {epsilon:g} error with power {res.power:.3f} only, not {power:g} "
                f"({len(law)} outcomes, mode {res.mode:.3f}{', ' + settings if settings else ''}): leave "
                f"runs=None (the check picks the N it needs), or pass require_power=False for a smoke run"
            )
        if runs is None and res.power < power:
            raise VacuousCheck(
                f"the target's law here is too flat: {max_runs} runs (max_runs) detect a TV {epsilon:g} "
                f"error with power {res.power:.3f} only, not {power:g} ({len(law)} outcomes, mode "
                f"{res.mode:.3f}{', ' + settings if settings else ''}): lower the temperature or top_k, or "
                "raise max_runs"
            )
        where = {k: i for i, g in enumerate(groups) for k in g}
        return cls(law, n, res, groups, probs, [0] * len(groups), where)

    def tv(self) -> float:
        """Total variation between the sampled cells and P's."""
        m = sum(self.counts)
        return 0.5 * sum(abs(c / m - p) for c, p in zip(self.counts, self.probs)) if m else 0.0

    def add(self, tokens: list[int], stats: Any = None) -> str | None:  # stats: hippo.types.Stats
        """Count one run's generated tokens (and its rounds); returns why the check fails, or None: a
        sequence P gives 0, or, at a look, a binomial test that rejects."""
        res, toks = self.result, tuple(tokens)
        if stats is not None:
            res.rounds += stats.rounds
            res.partial_rounds += partial_drafts(stats)
            res.rejected_rounds += sum(stats.rejected_per_round)
        res.runs += 1
        if toks not in self.where:
            return (
                f"run {res.runs} emitted {list(toks)}, a sequence the target gives probability 0 (a token "
                "it cannot emit there)"
            )
        self.counts[self.where[toks]] += 1
        if res.runs not in pw.look_sizes(self.runs):
            return None
        res.looks.append(res.runs)
        res.tv = self.tv()
        bad = pw.rejections(self.counts, self.probs, res.alpha)
        if not bad:
            return None
        return (
            f"the sequences' law is off after {res.runs} runs: TV {res.tv:.4f}; {len(bad)} binomial test(s) "
            f"reject at level {res.alpha:.0e}: {bad[0]}"
        )

    def details(self) -> str:
        """The cells' counts against P, and the summary."""
        cells = ", ".join(
            f"{[list(k) for k in g[:2]]}{'...' if len(g) > 2 else ''}: {c} runs, P = {p:.4f}"
            for g, c, p in zip(self.groups, self.counts, self.probs)
        )
        return f"cells (sequences: runs, target's P): {cells}; {self.result.summary()}"

    def require_partial(self, drafts: bool = True) -> None:
        """The vacuity guard: `VacuousCheck` when the runs drafted but no drafting was accepted in part
        (`reference.partial_drafts`): the rules after an acceptance and after a rejection never met."""
        if drafts and not self.result.partial_rounds:
            raise VacuousCheck(f"no drafting was accepted in part: {self.result.summary()}")


# ---- the suite's law checks (tests/lossless/test_sampling.py; `python -m hippo.testing.sampling`) ------

#: The parallel schedules' corrupted draft positions: a block q drafted beside p is verified from its
#: second token on (its first is q's guess of p's next token, checked when p emits it), so its third
#: token is the one a rejection strikes after an acceptance (DEFAULTS' second would be the block's
#: first verified token: no drafting accepted in part).
PARALLEL_CORRUPT = (False, False, True)

#: name -> settings: chain and tree, serial and parallel schedules (`pearl` too), every adapter, top_p
#: and the repetition penalty, γ from the cost model; each on a peaked law (its temperature) so that N
#: stays small. Keys besides DEFAULTS': "adapter", "scheduler", "drafter", "drafter_options" (the
#: drafter's own options, e.g. a tree's shape), "scheduler_options", "executor".
LAW_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_5_vl hippo chain top_p": {
        "scheduler": "hippo",
        "corrupt": PARALLEL_CORRUPT,
        "temperature": 0.01,
        "top_k": None,
        "top_p": 0.99,
    },
    "qwen3_vl serial chain top_k=3": {"adapter": "qwen3_vl", "temperature": 0.0031, "top_k": 3},
    "llava_onevision hippo chain repetition_penalty": {
        "adapter": "llava_onevision",
        "scheduler": "hippo",
        "corrupt": PARALLEL_CORRUPT,
        "temperature": 0.0033,
        "repetition_penalty": 1.3,
    },
    "video_salmonn2_plus serial tree": {
        "adapter": "video_salmonn2_plus",
        "drafter": "tree",
        "temperature": 0.0031,
    },
    # pearl verifies x_1 alone, then the block drafted beside p from its second token on: six new
    # tokens, so a block drafted ahead is verified (with four, x_1 and p's tokens fill the answer);
    # T = 0.006: the likeliest answer 0.861, 2,480 runs for the power
    "qwen2_5_vl pearl chain": {
        "scheduler": "pearl",
        "corrupt": PARALLEL_CORRUPT,
        "temperature": 0.006,
        "new_tokens": 6,
    },
    # a static tree, two children at the root, each with a chain below: a draft whose q is flatter
    # than p (`models.flat_draft`) has its first children rejected often, so the siblings' rule and
    # the residual run on most rounds (q ~ p, from a self draft, leaves a residual bug under TV 0.03)
    "qwen2_5_vl serial_tree static tree": {
        "scheduler": "serial_tree",
        "drafter": "tree",
        "drafter_options": {"paths": SIBLING_TREE},
        "draft": "flat",
        "keep_ratio": 0.25,
        "temperature": 0.0098,
        "top_k": 3,
    },
    # a dynamic (best-first) tree, the draft on its own thread with its forked policy; from a quarter
    # of the video (from half, q is so close to p that every tree is accepted whole)
    "qwen2_5_vl hippo dynamic tree on a thread": {
        "scheduler": "hippo",
        "drafter": "tree",
        "drafter_options": {"budget": 6, "top_k": 2},
        "executor": "thread",
        "keep_ratio": 0.25,
        "temperature": 0.01,
    },
    # γ from the cost model, round by round: serial on fixed costs under which drafting pays (on the
    # measured ones the target drafting for itself costs as much as verifying, and the planner keeps
    # γ <= 1), from the whole video (on this prompt, q from part of it ranks p's token second where
    # the corruption strikes, so x_2 would be accepted); hippo on measured times (its prefill buffer
    # is verified γ tokens at a time)
    "qwen2_5_vl serial chain gamma=auto": {
        "gamma": "auto",
        "scheduler_options": {"costs": DRAFTING_PAYS},
        "keep_ratio": 1.0,
        "temperature": 0.01,
    },
    "qwen2_5_vl hippo chain gamma=auto": {
        "scheduler": "hippo",
        "gamma": "auto",
        "corrupt": PARALLEL_CORRUPT,
        "temperature": 0.01,
    },
    # scheduler="auto" on fixed costs under which drafting pays: it picks a drafting schedule per job
    "qwen2_5_vl auto chain": {"scheduler": "auto", "temperature": 0.01},
    # the draft in its own process (spawned once per pipeline: seconds); as `pearl`'s, six tokens
    # (its prefill buffer is mostly empty here: the tiny target prefills before q drafts one)
    "qwen2_5_vl hippo chain process executor": {
        "scheduler": "hippo",
        "executor": "process",
        "corrupt": PARALLEL_CORRUPT,
        "temperature": 0.006,
        "new_tokens": 6,
    },
}

#: The compiled target (tests/lossless/test_static.py): the target on a static KV cache with a
#: compiled forward ("compile": the roles), serial chain drafting on the default case. It promises the
#: eager pipeline's draws seed by seed ("couple": `coupled_config_check` against the same configuration
#: without "compile", whose law `hippo check --sampling` and the serial path check at full power).
COMPILED_TARGET: dict[str, Any] = {"compile": ("target",), "couple": True}

#: A row of a batch (tests/lossless/test_batched.py): the default case decoded as the second row of a
#: batch of two (`BatchRow`), beside a row of another video and length. It promises batch 1's draws
#: with the same γ and seed ("couple").
BATCHED: dict[str, Any] = {"batch": True, "couple": True}
#: the keys of a configuration that make it a coupled path, not a configuration of its own
PATH_KEYS = ("batch", "compile", "couple")


class BatchRow:
    """A pipeline whose `generate` decodes its prompt as the second row of a batch of two
    (`generate_batch`): the other row (another video and length, its own seed) drafts, rejects and
    finishes beside it. Every answer's stats say the batched engine ran ("batch of 2" in its notes)."""

    closes_with_check = True  # built by `config_build`: the check closes it

    def __init__(self, pipe: Any, other: dict):
        self.pipe, self.other = pipe, other

    def generate(self, inputs: dict, seed: int | None = None, **gen: Any) -> Any:
        other = None if seed is None else seed + 10**6
        out = self.pipe.generate_batch([self.other, inputs], seeds=[other, seed], **gen)[1]
        if not any("batch of 2" in n for n in out.stats.notes):
            raise AssertionError(f"the row was not decoded in a batch: {out.stats.notes}")
        return out

    def close(self) -> None:
        self.pipe.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)


def config_build(
    cfg: dict[str, Any], verifier: str | None = None, drafter: str | None = None
) -> Callable[[Case], Any]:
    """The pipeline a LAW_CONFIGS entry (or COMPILED_TARGET, BATCHED) checks: `case.builder` with its
    scheduler (and "scheduler_options"), drafter (or `drafter`) and `verifier`; "drafter_options" (a
    tree's shape) replace the drafter, and with it the corrupting wrapper (which passes trees through
    unchanged); "compile" compiles those roles; "batch" decodes each run as a row of a batch
    (`BatchRow`)."""
    scheduler, drafter = cfg.get("scheduler", "serial"), drafter or cfg.get("drafter", "chain")

    def build(case: Case) -> Any:
        b = case.builder(scheduler, drafter=drafter, verifier=verifier, **cfg.get("scheduler_options", {}))
        if "drafter_options" in cfg:
            b.drafter(drafter, **cfg["drafter_options"])
        if cfg.get("compile"):
            b.compile(*cfg["compile"])
        if cfg.get("batch"):
            target = case.target
            unit = pixel_unit(target)
            other = Prompt(case.adapter, target, (3, unit, 2 * unit), 6, [], []).inputs
            return BatchRow(b.build(), other)
        return b

    return build


def config_check(
    cfg: dict[str, Any], verifier: str | None = None, drafter: str | None = None, **options: Any
) -> SamplingResult:
    """`assert_sampling_exact` on a LAW_CONFIGS entry (with `verifier` or `drafter` in place of the
    stock ones, and `options` overriding); a coupled path's (`cfg["couple"]`) is `coupled_config_check`."""
    if cfg.get("couple"):
        return coupled_config_check(cfg, verifier, drafter, **options)
    settings = {k: v for k, v in cfg.items() if k in DEFAULTS}
    return assert_sampling_exact(
        config_build(cfg, verifier, drafter),
        adapter=cfg.get("adapter"),
        executor=cfg.get("executor", "inline"),
        **{**settings, **options},
    )


def _config_case(cfg: dict[str, Any]) -> tuple[Case, dict[str, Any]]:
    """A configuration's case (`sampling_case`) and its settings (DEFAULTS overridden by it)."""
    opts = {**DEFAULTS, **{k: v for k, v in cfg.items() if k in DEFAULTS}}
    case = sampling_case(
        cfg.get("adapter"),
        draft=opts["draft"],
        gamma=opts["gamma"],
        keep_ratio=opts["keep_ratio"],
        new_tokens=opts["new_tokens"],
        corrupt=opts["corrupt"],
        executor=cfg.get("executor", "inline"),
    )
    return case, opts


def _run(pipe: Any, inputs: dict, length: int, gen: dict[str, Any]) -> Callable[[int], tuple[list[int], Any]]:
    def run(seed: int) -> tuple[list[int], Any]:
        out = pipe.generate(inputs, seed=seed, **gen)
        return out.sequences[0, length:].cpu().tolist(), out.stats

    return run


def coupled_config_check(
    cfg: dict[str, Any], verifier: str | None = None, drafter: str | None = None, *, seed: int = 0
) -> Any:
    """The check of a coupled path (COMPILED_TARGET, BATCHED: `cfg["couple"]`): the path, with `verifier`
    or `drafter` in place of the stock ones, draws on `coupled_runs()` seeds what the honest
    configuration without its path keys (`PATH_KEYS`) draws (`hippo.testing.coupled`); that
    configuration's law is checked at full power. Returns a `CoupledResult`."""
    from hippo.testing.coupled import assert_same_draws

    case, opts = _config_case(cfg)
    gen = generation(
        opts["temperature"], opts["top_k"], opts["top_p"], opts["repetition_penalty"], opts["new_tokens"]
    )
    reference_cfg = {k: v for k, v in cfg.items() if k not in PATH_KEYS}
    path_name = " and ".join(k for k in ("batch", "compile") if cfg.get(k)) or "path"
    what = {
        "batch": "a batch row must draw what batch 1 draws with the same γ and seed",
        "compile": "a compiled target must draw what the eager one draws",
    }.get(path_name, "the path must draw what its reference draws")
    L = case.prompt.length
    with corrupting_plugin():
        path, owned = make_pipeline(config_build(cfg, verifier, drafter), case)
        reference, _ = make_pipeline(config_build(reference_cfg), case)
        try:
            return assert_same_draws(
                _run(path, case.inputs, L, gen),
                _run(reference, case.inputs, L, gen),
                what=what,
                case=case.short() + f", {path_name}",
                parts=part_names(path),
                reproduce=(
                    f"coupled_config_check({cfg!r}, verifier={verifier!r}, drafter={drafter!r}, seed={seed})"
                ),
                seed=seed,
            )
        finally:
            reference.close()
            if owned:
                path.close()


#: A conversation's second turn (tests/lossless/test_conversation.py): `sampling_case`'s video and
#: text, question 1 (the case's text after the video) answered greedily with `answer` tokens from a
#: cached context, then question 2 (`question`: text-id picks) sampled; its law is the target's on
#: the whole turn-2 prompt. The serial schedule (it draws bonus tokens; the parallel ones' cached
#: contexts are checked greedily in test_conversation.py, and their sampling rule in LAW_CONFIGS).
SECOND_TURN: dict[str, Any] = {
    "scheduler": "serial",
    "answer": 3,
    "question": (30, 32),
    "temperature": 0.0094,
    "top_k": 2,
    "new_tokens": 4,
}


#: The law of tests/lossless/test_planner.py's switching checks (rounds and target-only steps mixed
#: within each run under `gamma="auto"`): `sampling_case`'s, sampled with these settings.
SWITCHING: dict[str, Any] = {"temperature": 0.01, "top_k": 2}


def second_turn_prompts(adapter: str | None = None) -> tuple[Case, list[int], Prompt]:
    """(the case, whose prompt is turn 1; turn 1's greedy answer by `target.generate`, cut before its
    first special id: a placeholder cannot be re-fed as text, as LLaVA-OneVision's tiny target would
    answer; the whole turn-2 prompt: the case's, the answer, question 2)."""
    case = sampling_case(adapter)
    first, target = case.prompt, case.target
    ref = reference(target, first.inputs, do_sample=False, max_new_tokens=SECOND_TURN["answer"])
    answer, special = ref[0, first.length :].tolist(), special_ids(target)
    answer = answer[: next((i for i, t in enumerate(answer) if t in special), len(answer))]
    if not answer:
        raise ConfigError(
            f"turn 1's greedy answer on {case.adapter}'s tiny target starts with a special id: the "
            "conversation law check has no text answer to re-feed"
        )
    lo, hi = SECOND_TURN["question"]
    after = (*case.after, *answer, *text_ids(target)[lo:hi])
    return case, answer, Prompt(case.adapter, target, case.grid, case.video_seed, case.before, after)


def second_turn_calibration(adapter: str | None = None, **bounds: Any) -> Any:
    """Turn 2's calibrated temperature on `adapter` (`hippo.testing.calibration`: SECOND_TURN's where
    its law is checkable, else the checkable one with the fewest runs; cached per process)."""
    from hippo.testing.calibration import calibrated, score_tree

    case, _, second = second_turn_prompts(adapter)
    key = (
        "second turn",
        case.adapter,
        SECOND_TURN["answer"],
        SECOND_TURN["question"],
        SECOND_TURN["new_tokens"],
    )

    def tree() -> Any:
        return score_tree(case.target, second.inputs, SECOND_TURN["new_tokens"], SECOND_TURN["top_k"])

    what = f"a conversation's turn 2 on {case.adapter}'s tiny target"
    return calibrated(key, tree, SECOND_TURN["temperature"], SECOND_TURN["top_k"], None, what, **bounds)


def second_turn_law(
    adapter: str | None = None, temperature: float | None = None
) -> dict[tuple[int, ...], float]:
    """The target's exact law of turn 2's first tokens under SECOND_TURN's settings (cached), at
    `temperature` (None: SECOND_TURN's)."""
    case, _, second = second_turn_prompts(adapter)
    t = SECOND_TURN["temperature"] if temperature is None else temperature
    key = ("second turn", case.adapter, *sorted({**SECOND_TURN, "temperature": t}.items()))
    if key not in _LAWS:
        proc = warpers(t, SECOND_TURN["top_k"])
        _LAWS[key] = exact_law(
            case.target,
            second.inputs,
            SECOND_TURN["new_tokens"],
            proc,
            set(eos_ids(case.target)),
            MAX_OUTCOMES,
        )
    return _LAWS[key]


def _second_turn_setup(
    adapter: str | None, temperature: float | None = None
) -> tuple[Case, list[int], Prompt, Any, dict[str, Any]]:
    """(the case, turn 1's answer, the whole turn-2 prompt: `second_turn_prompts`; question 2's tokens
    [n]; turn 2's `generate` settings, at `temperature`, None: SECOND_TURN's)."""
    import torch

    case, answer, second = second_turn_prompts(adapter)
    lo, hi = SECOND_TURN["question"]
    question = torch.tensor(text_ids(case.target)[lo:hi])
    t = SECOND_TURN["temperature"] if temperature is None else temperature
    gen = generation(t, SECOND_TURN["top_k"], None, None, SECOND_TURN["new_tokens"])
    return case, answer, second, question, gen


def _second_turn_pipeline(
    case: Case, corrupting: str, verifier: str | None, drafter: str | None, scheduler: str | None
) -> Any:
    """SECOND_TURN's pipeline: the target drafting for itself from the case's share of the video, γ = 3,
    each drafting's second token replaced by q's second choice; `verifier`, `drafter` (the corrupted
    base) or `scheduler` in place of the stock ones."""
    from hippo.testing.reference import build_pipeline

    return build_pipeline(
        case.target,
        case.target,
        scheduler=scheduler or SECOND_TURN["scheduler"],
        gamma=3,
        keep_ratio=case.keep_ratio,
        drafter=corrupting,
        drafter_options={"wrong": (False, True), "base": drafter or "chain"},
        verifier=verifier,
    )


def _second_turn_conversation(pipe: Any, case: Case, answer: list[int], result: Any, reproduce: str) -> Any:
    """A conversation on the case's video whose turn 1 was answered greedily from a cached context; a
    `LosslessViolation` when that answer is not `target.generate`'s (a bug greedy decoding sees too)."""
    from hippo.testing.reference import new_tokens

    first = case.prompt
    ctx = pipe.prepare(first.inputs)
    conv = pipe.conversation(ctx)
    a1 = conv.ask(first.inputs["input_ids"][0, ctx.length :], max_new_tokens=len(answer), do_sample=False)
    got = new_tokens(a1.sequences, first.length)
    if got != answer:
        report = Report(
            check="greedy",
            summary=f"turn 1's greedy answer {got} is not target.generate's {answer}",
            case=f"{case.short()}, turn 1 of a conversation",
            parts=part_names(pipe),
            reproduce=reproduce,
        )
        raise LosslessViolation(report, result)
    return conv


def _second_turn_run(conv: Any, question: Any, second: Prompt, gen: dict[str, Any]) -> Callable[[int], Any]:
    """(seed) -> (turn 2's new tokens, stats), each run from the conversation after turn 1."""
    import torch

    from hippo.testing.reference import new_tokens

    def run(seed: int) -> tuple[list[int], Any]:
        conv.turns = conv.turns[:1]
        out = conv.ask(question, seed=seed, **gen)
        if not torch.equal(out.sequences[0, : second.length], second.inputs["input_ids"][0]):
            raise AssertionError("turn 2's prompt is not the whole conversation")
        return new_tokens(out.sequences, second.length), out.stats

    return run


def second_turn_check(
    verifier: str | None = None,
    drafter: str | None = None,
    *,
    seed: int = 0,
    adapter: str | None = None,
    scheduler: str | None = None,
    temperature: float | None = None,
) -> SamplingResult:
    """The law check of a conversation's second turn (SECOND_TURN): turn 1 answered greedily from a
    cached context (it must be `target.generate`'s answer), then turn 2 sampled N times from the same
    context (seeds seed, seed+1, ...), with `verifier`, `drafter` or `scheduler` in place of the stock
    ones (SECOND_TURN's). The target drafts for itself from half the video, each drafting's second
    token replaced by q's second choice. Raises `LosslessViolation` (with the result) when the law is
    off, `VacuousCheck` when no drafting was accepted in part. `temperature=None` is the adapter's
    calibrated one (`second_turn_calibration`: SECOND_TURN's where checkable, as on Qwen2.5-VL).
    `hippo check --sampling` runs it on a part; the suite's conversation path is `second_turn_coupled`."""
    from hippo.testing.drafters import corrupting_plugin

    if temperature is None:
        temperature = second_turn_calibration(adapter).temperature
    case, answer, second, question, gen = _second_turn_setup(adapter, temperature)
    check = LawCheck.plan(second_turn_law(adapter, temperature), settings=f"SECOND_TURN, T={temperature:g}")
    res = check.result
    reproduce = (
        f"second_turn_check({verifier!r}, {drafter!r}, seed={seed}, adapter={case.adapter!r}, "
        f"scheduler={scheduler!r}, temperature={temperature!r})"
    )
    with corrupting_plugin() as corrupting:
        pipe = _second_turn_pipeline(case, corrupting, verifier, drafter, scheduler)
        try:
            run = _second_turn_run(
                _second_turn_conversation(pipe, case, answer, res, reproduce), question, second, gen
            )
            # the turn's encoding, p's extension by the question and q's prefill shared by the runs,
            # their forwards replayed by history (`hippo.testing.prefill`)
            with shared_prefill(pipe, replay=True, turns=True):
                for i in range(check.runs):
                    tokens, stats = run(seed + i)
                    failure = check.add(tokens, stats)
                    if failure is None:
                        continue
                    report = Report(
                        check="sampling",
                        summary=f"turn 2, seeds {seed}..{seed + i}: {failure}",
                        case=f"{case.short()}, turn 2 of a conversation, {SECOND_TURN}, T={temperature:g}",
                        parts=part_names(pipe),
                        reproduce=reproduce,
                        details=check.details(),
                    )
                    raise LosslessViolation(report, res)
        finally:
            pipe.close()
    check.require_partial()
    return res


def second_turn_coupled(
    verifier: str | None = None,
    drafter: str | None = None,
    *,
    seed: int = 0,
    adapter: str | None = None,
    scheduler: str | None = None,
) -> Any:
    """The conversation path's check: turn 2 from a cached context (SECOND_TURN, with `verifier`,
    `drafter` or `scheduler` in place of the stock ones) draws on `coupled_runs()` seeds what the honest
    pipeline's `generate` draws on the whole turn-2 prompt (`hippo.testing.coupled`), whose law is
    the serial path's. Returns a `CoupledResult`."""
    from hippo.testing.coupled import CoupledResult, assert_same_draws
    from hippo.testing.drafters import corrupting_plugin

    case, answer, second, question, gen = _second_turn_setup(adapter)
    reproduce = f"second_turn_coupled({verifier!r}, {drafter!r}, seed={seed}, scheduler={scheduler!r})"
    with corrupting_plugin() as corrupting:
        pipe = _second_turn_pipeline(case, corrupting, verifier, drafter, scheduler)
        honest = _second_turn_pipeline(case, corrupting, None, None, None)
        try:
            conv = _second_turn_conversation(pipe, case, answer, CoupledResult(), reproduce)
            return assert_same_draws(
                _second_turn_run(conv, question, second, gen),
                _run(honest, second.inputs, second.length, gen),
                what="a conversation's later turn must draw what generate draws on the whole conversation",
                case=f"{case.short()}, turn 2 of a conversation, {SECOND_TURN}",
                parts=part_names(pipe),
                reproduce=reproduce,
                seed=seed,
            )
        finally:
            pipe.close()
            honest.close()


def config_law(cfg: dict[str, Any]) -> dict[tuple[int, ...], float]:
    """The exact law a LAW_CONFIGS entry is checked against."""
    case, opts = _config_case(cfg)
    return target_law(case, opts["temperature"], opts["top_k"], opts["top_p"], opts["repetition_penalty"])


__all__ = [
    "DEFAULTS",
    "TREE_SETTINGS",
    "LAW_CONFIGS",
    "COMPILED_TARGET",
    "BATCHED",
    "MAX_MODE",
    "SECOND_TURN",
    "SWITCHING",
    "BatchRow",
    "Prompt",
    "LawCheck",
    "SamplingResult",
    "assert_sampling_exact",
    "case_calibration",
    "config_build",
    "config_check",
    "config_law",
    "default_adapter",
    "sampling_case",
    "second_turn_calibration",
    "second_turn_check",
    "second_turn_coupled",
    "coupled_config_check",
    "PATH_KEYS",
    "second_turn_law",
    "second_turn_prompts",
    "target_law",
]


# ---- the suite's numbers: `python -m hippo.testing.sampling` ------------------------------------


def power_table() -> None:  # pragma: no cover - a report
    """Print each law check of the suite with its cells, N and power against a TV error of EPSILON."""
    print(
        f"false alarms: {pw.SUITE_ALPHA:g} per suite run over {pw.SUITE_CHECKS} checks = alpha {pw.ALPHA:.0e} per "
        f"check (exact binomial tests, Bonferroni over sets of cells and {len(pw.LOOKS)} looks)"
    )
    print(f"power: the worst case over every law at total variation {pw.EPSILON} from the target's")
    print(
        f"every check's likeliest sequence must hold <= MAX_MODE = {MAX_MODE} (a greedy collapse is then seen)"
    )
    print(f"{'configuration':<48} {'K':>2} {'P(mode)':>7} {'spread':>6} {'N':>5} {'power':>6}")
    configs = {f"default (hippo check --sampling, T={DEFAULTS['temperature']})": {}, **LAW_CONFIGS}
    for name, cfg in configs.items():
        law = config_law(cfg)
        probs = pw.cell_probs(law, pw.cells(law))
        n = pw.runs_for(law)
        print(
            f"{name:<48} {len(probs):>2} {max(probs):>7.3f} {pw.spread(probs):>6.3f} {n:>5} "
            f"{pw.power_of(law, n):>6.3f}"
        )
    others = {
        f"conversation turn 2 ({SECOND_TURN['scheduler']}, cached context)": second_turn_law(),
        "planner switching (serial, hippo; gamma=auto)": target_law(sampling_case(), **SWITCHING),
    }
    for name, law in others.items():
        probs = pw.cell_probs(law, pw.cells(law))
        n = pw.runs_for(law)
        print(
            f"{name:<48} {len(probs):>2} {max(probs):>7.3f} {pw.spread(probs):>6.3f} {n:>5} "
            f"{pw.power_of(law, n):>6.3f}"
        )
    law = config_law(TREE_SETTINGS)
    n = pw.runs_for(law)
    probs = pw.cell_probs(law, pw.cells(law))
    print(
        f"{'hippo check, tree parts, siblings tested (targeted)':<48} {len(probs):>2} {max(probs):>7.3f} "
        f"{pw.spread(probs):>6.3f} {n:>5} {pw.power_of(law, n):>6.3f}"
    )
    from hippo.testing.coupled import coupled_runs

    k = coupled_runs()
    print(
        f"coupled paths (batched rows, compiled target, conversation turn 2): {k} seeds each, the same draws "
        f"as their reference's; power {1 - (1 - pw.EPSILON) ** k:.3f} against a TV {pw.EPSILON} error"
    )


if __name__ == "__main__":  # pragma: no cover
    power_table()
