"""`hippo check NAME`: the harness run on one installed part, combined with the built-in parts it needs.

`check_plugin` returns a `CheckResult` (exit status 0: lossless on every case, 1: a counterexample,
with its report) and raises a HippoError for bad usage (exit 2): an unknown name, a name registered
under several kinds without `kind`, a part that cannot be built with its defaults (the message names
the missing options), a plugin whose registration hook raises (the message names its distribution).
The batch check (`hippo.testing.batch`) follows: the part inside a continuous batch, with rows joining
mid-flight and cancelled. With `sampling`, the law test runs on more than one configuration
(`sampling_plan`), each a path of the planted-bug matrix (`hippo.testing.matrix`) the part can take
part in, in order, the first that fails stopping the check: token trees with siblings tested
(TREE_SETTINGS) for tree parts (a verifier of token trees, one with `Verifier.trees`, is given the
tree drafter); the default case (`assert_sampling_exact`, serial chain drafting) for every part; and
a conversation's later turn (SECOND_TURN: a cached context, γ = 3, the serial schedule, or the part
as the scheduler) for schedulers, drafters and verifiers. Each runs at its law case's temperature on
the adapter (`calibration.law_case`): the stage's stock one where its law is checkable on that
backbone's tiny target, else the checkable one with the fewest runs, computed from the target's logits.
"""

from __future__ import annotations

from typing import Any

import attrs

from hippo.errors import ConfigError, HippoError, PluginError
from hippo.registry import KINDS, origin_of, plugin_manager, registry
from hippo.testing.case import Case
from hippo.testing.models import config_fields, part_class, required_options

#: Options the harness itself gives a part when its Config has them.
SUPPLIED = {"gamma", "keep_ratio", "seed", "executor", "executor_options"}
CHECKABLE = ("schedulers", "selectors", "scorers", "drafters", "verifiers", "executors", "adapters")


def safe_registry(kind: str) -> dict[str, tuple[type, str]]:
    """`registry(kind)`, with a raising `hippo_register_<kind>` hook named by its distribution."""
    pm = plugin_manager()
    for impl in getattr(pm.hook, f"hippo_register_{kind}").get_hookimpls():
        try:
            impl.function()
        except Exception as exc:
            raise PluginError(
                f"the hippo_register_{kind} hook of {origin_of(pm, impl.plugin)} raised "
                f"{type(exc).__name__}: {exc}; fix or uninstall that distribution"
            ) from exc
    return registry(kind)


def find_kind(name: str, kind: str | None = None) -> tuple[str, str]:
    """(kind, source) of the part registered as `name`; `kind` may be singular or plural."""
    if kind is not None:
        kind = kind if kind.endswith("s") else kind + "s"
        if kind not in CHECKABLE:
            raise ConfigError(f"--kind {kind!r} is not one of {', '.join(k[:-1] for k in CHECKABLE)}")
    found = {k: safe_registry(k)[name][1] for k in KINDS if name in safe_registry(k)}
    if kind is not None:
        if kind not in found:
            known = ", ".join(sorted(safe_registry(kind))) or "none"
            raise PluginError(f"no {kind[:-1]} named {name!r} is installed; installed {kind}: {known}")
        return kind, found[kind]
    if not found:
        known = "; ".join(f"{k}: {', '.join(sorted(safe_registry(k))) or 'none'}" for k in CHECKABLE)
        raise PluginError(f"no part named {name!r} is installed (see `hippo plugins`); installed {known}")
    if len(found) > 1:
        raise ConfigError(
            f"{name!r} is registered as {' and '.join(k[:-1] for k in found)}: choose one with --kind"
        )
    return next(iter(found.items()))


def is_tree_verifier(cls: type) -> bool:
    """A verifier of token trees (`Verifier.trees`, like the stock ones)."""
    return bool(getattr(cls, "trees", False))


def _first(kind: str, want: Any, prefer: tuple[str, ...]) -> str | None:
    names = [n for n, (cls, _) in sorted(registry(kind).items()) if want(cls)]
    return next((n for n in prefer if n in names), names[0] if names else None)


@attrs.frozen
class plugin_build:  # noqa: N801 - used like a function in reproduction lines
    """The pipeline `hippo check` builds around one part: `plugin_build(kind, name)(case)`."""

    kind: str
    name: str

    def __call__(self, case: Case) -> Any:
        k, n = self.kind, self.name
        if k == "schedulers":
            return case.builder(scheduler=n)
        if k == "selectors":
            scorer = (
                _first("scorers", lambda c: True, ("holistic",)) if part_class(k, n).needs_scores else None
            )
            return case.builder(selector=n, scorer=scorer)
        if k == "scorers":
            selector = _first("selectors", lambda c: c.needs_scores, ("topk",)) or "uniform"
            return case.builder(selector=selector, scorer=n)
        if k == "drafters":
            return case.builder(drafter=n)
        if k == "verifiers":
            if is_tree_verifier(part_class(k, n)):  # it verifies token trees: give it trees
                from hippo.testing.sampling import SIBLING_TREE

                tree = _first("drafters", lambda c: True, ("tree",))
                b = case.builder(drafter=tree, verifier=n)
                return b.drafter(tree, paths=SIBLING_TREE) if tree == "tree" else b
            return case.builder(verifier=n)
        if k == "executors":
            scheduler = _first("schedulers", lambda c: "executor" in config_fields(c), ("hippo", "pearl"))
            if scheduler is None:
                raise ConfigError(f"executor {n!r}: no installed scheduler takes an executor")
            return case.builder(scheduler=scheduler, executor=n)
        return case.builder()  # adapters: the default pipeline on that adapter's tiny pair

    def reproduction(self) -> tuple[str, str]:
        return "from hippo.testing import plugin_build; ", repr(self)

    def __repr__(self) -> str:
        return f"plugin_build({self.kind!r}, {self.name!r})"


def sampling_plan(kind: str, name: str) -> list[str]:
    """The law checks `hippo check NAME --sampling` runs on the part, in order (see the module doc):
    "token trees" (tree parts: siblings are tested there only), "default" (where the chain bugs of the
    planted-bug matrix are caught soonest: `python -m hippo.testing.matrix`), "conversation turn 2"."""
    tree = (kind == "verifiers" and is_tree_verifier(part_class(kind, name))) or (
        kind == "drafters" and name == "tree"
    )
    plan = ["token trees", "default"] if tree else ["default"]
    if kind in ("schedulers", "drafters", "verifiers") and not (kind == "drafters" and name == "tree"):
        plan.append("conversation turn 2")
    return plan


def _sampling_check(which: str, kind: str, name: str, build: Any, adapter: str, seed: int) -> Any:
    """One stage of `sampling_plan` on `adapter`, at its law case's temperature (`calibration.law_case`:
    the stage's stock one where checkable on that backbone, else the calibrated one)."""
    from hippo.testing.calibration import law_case
    from hippo.testing.sampling import TREE_SETTINGS, assert_sampling_exact, second_turn_check

    t = law_case(adapter, which)["temperature"]
    if which == "token trees":
        return assert_sampling_exact(build, adapter=adapter, seed=seed, **{**TREE_SETTINGS, "temperature": t})
    if which == "conversation turn 2":
        part = {"schedulers": "scheduler", "drafters": "drafter", "verifiers": "verifier"}[kind]
        return second_turn_check(seed=seed, adapter=adapter, temperature=t, **{part: name})
    return assert_sampling_exact(build, adapter=adapter, seed=seed, temperature=t)


#: what each law check of `sampling_plan` is, in `hippo check`'s output
SAMPLING_LABELS = {
    "token trees": "token trees with siblings tested",
    "conversation turn 2": "a conversation's later turn from a cached context",
    "default": "the default case",
}


@attrs.define
class CheckResult:
    kind: str
    name: str
    source: str
    status: int = 0  # 0 lossless, 1 counterexample
    lines: list = attrs.field(factory=list)
    stage: str = "greedy"  # the check running (or that failed): "greedy" or one of `sampling_plan`'s

    def text(self) -> str:
        return "\n".join(self.lines)


def _check_buildable(kind: str, name: str) -> None:
    cls = part_class(kind, name)
    missing = [o for o in required_options(cls) if o not in SUPPLIED]
    if missing:
        raise ConfigError(
            f"{kind[:-1]} {name!r} cannot be built with its defaults: option(s) {', '.join(missing)} have no "
            f"default. Check it from Python with hippo.testing.assert_greedy_lossless(lambda case: "
            f"case.builder(...)) and pass {', '.join(f'{o}=...' for o in missing)}"
        )


def check_plugin(
    name: str,
    kind: str | None = None,
    *,
    examples: int = 20,
    seed: int = 0,
    sampling: bool = False,
    adapters: list[str] | None = None,
    shrink: bool = True,
    laws: list[str] | None = None,
) -> CheckResult:
    """Run the greedy harness (and with `sampling` the law test) on the part registered as `name`;
    `laws`: the configurations of its `sampling_plan` to run the law on (None: all of them)."""
    from hypothesis.errors import Flaky

    from hippo.testing.batch import assert_batch_lossless
    from hippo.testing.greedy import assert_greedy_lossless
    from hippo.testing.models import tiny_adapters
    from hippo.testing.report import LosslessViolation, VacuousCheck
    from hippo.testing.sampling import default_adapter

    if examples < 1:
        raise ConfigError(f"--examples must be >= 1, got {examples}")
    kind, source = find_kind(name, kind)
    _check_buildable(kind, name)
    plan = sampling_plan(kind, name)
    if laws is not None:
        if not sampling:
            raise ConfigError("--law picks the law checks of --sampling: add --sampling")
        unknown = [law for law in laws if law not in plan]
        if unknown:
            raise ConfigError(
                f"--law {unknown[0]!r} is not a law check of {kind[:-1]} {name!r}; its plan: "
                + ", ".join(repr(p) for p in plan)
            )
        plan = [p for p in plan if p in laws]
    build = plugin_build(kind, name)
    if kind == "adapters":
        if name not in tiny_adapters():
            raise ConfigError(
                f"adapter {name!r} ships no tiny model (Adapter.tiny_module), so it cannot be checked"
            )
        adapters = [name]
    res = CheckResult(kind, name, source)
    head = f"hippo check: {kind[:-1]} {name!r} from {source}"
    res.lines.append(head)
    try:
        # one default case first: a part that cannot be built is bad usage (exit 2), not a counterexample
        from hippo.testing.drafters import corrupting_plugin
        from hippo.testing.sampling import sampling_case

        with corrupting_plugin():
            probe = build(sampling_case((adapters or [None])[0]))
            if hasattr(probe, "build"):
                probe.build().close()
    except HippoError as exc:
        raise type(exc)(f"{kind[:-1]} {name!r} from {source} cannot be built with defaults: {exc}") from exc
    try:
        greedy = assert_greedy_lossless(build, adapters=adapters, examples=examples, seed=seed, shrink=shrink)
        res.lines.append(f"greedy: lossless on {greedy.summary()}")
        # inside a continuous batch, rows joining mid-flight and cancelled: half as many examples (each
        # is a batch of 2-4 rows); whether rows joined and were cancelled is judged from 8 on
        n = max(1, examples // 2)
        batch = assert_batch_lossless(
            build, adapters=adapters, examples=n, seed=seed, shrink=shrink, require=n >= 8
        )
        res.lines.append(f"batched: lossless on {batch.summary()}")
        if sampling:
            adapter = (adapters or [default_adapter()])[0]
            configurations = "configuration" if len(plan) == 1 else "configurations"
            res.lines.append(f"sampling: the law on {len(plan)} {configurations}: {', '.join(plan)}")
            for which in plan:
                res.stage = which
                law = _sampling_check(which, kind, name, build, adapter, seed)
                res.lines.append(f"sampling, {SAMPLING_LABELS[which]}: exact law, {law.summary()}")
    except LosslessViolation as exc:
        res.status = 1
        if res.stage != "greedy":
            res.lines.append(f"sampling: the law check on {SAMPLING_LABELS[res.stage]} FAILED")
        res.lines.append(exc.report.format())
        res.lines.append(
            f"  or run: hippo check {name} --kind {kind[:-1]} --examples {examples} --seed {seed}"
        )
    except VacuousCheck as exc:
        res.status = 1
        where = "" if res.stage == "greedy" else f" (the law check on {SAMPLING_LABELS[res.stage]})"
        res.lines.append(f"hippo.testing: the check proved nothing{where}: {exc}")
    except Flaky as exc:  # failed, then passed on the same case: the part is not deterministic
        res.status = 1
        inner = [e for e in getattr(exc, "exceptions", ()) if isinstance(e, LosslessViolation)]
        res.lines.append(
            f"hippo.testing: {kind[:-1]} {name!r} failed on a case and then passed on the same case: its "
            "output is not a function of the inputs and seed, which a lossless part's must be"
        )
        res.lines.extend(e.report.format() for e in inner[:1])
    except HippoError as exc:
        raise type(exc)(f"{kind[:-1]} {name!r} from {source}: {exc}") from exc
    else:
        res.lines.append(f"OK: {kind[:-1]} {name!r} is lossless on every case tried")
    return res
