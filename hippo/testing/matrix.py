"""The planted sampling bugs × the paths that sample: every bug a path exercises is caught.

Each path is run with a planted part (`hippo.testing.planted`) in place of the stock verifier or
drafter, through the same check that passes the honest pipeline in the suite (the test named in
`PATHS`), so a planted bug it rejects is caught by that check and not by a looser one:
- most paths by their own law check (`hippo.testing.sampling`), which stops at its first look that
  rejects (N/10, 3N/10, N: `power.LOOKS`), or at once on a sequence the target cannot emit: a caught
  bug costs the runs up to its rejection, an honest run all N (about 2,000);
- the coupled paths (a row of a batch, the compiled target, a conversation's later turn) by their
  promise to draw what a law-checked reference draws, seed by seed (`hippo.testing.coupled`), which
  stops at the first seed that differs: an honest run costs 59 seeds.

A bug a path cannot exercise is listed in `INERT` with the reason; it is not a test. The matrix, each
cell caught at which look or seed (or why not exercised), is printed by

    python -m hippo.testing.matrix [PATH ...]

(it runs every cell: about 8 minutes on two cores). tests/lossless/test_matrix.py runs the cells that
are exercised, each asserted caught: in CI's default tier the greedy-collapse column on every path and
every cell of the coupled paths but the compiled target (which recompiles for each planted part), the
rest in its matrix tier (`.ci/run`: `python -m pytest -m matrix`).
Notation: p = target, q = draft, N = a check's runs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import attrs

from hippo.testing import sampling as hs
from hippo.testing.planted import PLANTED, planted_plugin
from hippo.testing.report import LosslessViolation


@attrs.frozen
class Path:
    """One path with a law check: its configuration and the suite test that passes it honestly."""

    name: str
    config: dict[str, Any]  # a LAW_CONFIGS-style configuration (`sampling.config_check`)
    honest: str  # the suite test whose honest run of this check passes
    chain: bool = True  # drafts chains (no siblings), not token trees
    batched: bool = False  # drafts in the batch engine (a drafter takes part via rewrite_chain)
    bonus: bool = True  # draws bonus tokens (every built-in path does: the engine's round emits one)
    check: Callable[..., hs.SamplingResult] | None = None  # None: `config_check(config, ...)`
    #: checked by its promise to draw what a law-checked reference draws, seed by seed
    #: (`hippo.testing.coupled`: 59 seeds), not by a law check of its own
    coupled: bool = False

    def run(
        self, verifier: str | None = None, drafter: str | None = None, seed: int = 0
    ) -> hs.SamplingResult:
        """This path's law check with `verifier` / `drafter` in place of the stock ones."""
        if self.check is not None:
            return self.check(verifier, drafter, seed=seed)
        return hs.config_check(self.config, verifier, drafter, seed=seed)


PATHS: dict[str, Path] = {
    p.name: p
    for p in (
        Path(
            "serial",
            {},
            "tests/test_testing.py::test_installed_plugins_with_hippo_check_and_their_own_suite (fixed_chain)",
        ),
        Path("pearl", hs.LAW_CONFIGS["qwen2_5_vl pearl chain"], "tests/lossless/test_sampling.py"),
        Path(
            "hippo",
            hs.LAW_CONFIGS["qwen2_5_vl hippo chain gamma=auto"],
            "tests/lossless/test_sampling.py",
        ),
        Path(
            "token trees",
            hs.LAW_CONFIGS["qwen2_5_vl serial_tree static tree"],
            "tests/lossless/test_sampling.py",
            chain=False,
        ),
        Path(
            "batched rows",
            hs.BATCHED,
            "tests/lossless/test_batched.py::test_a_batch_row_draws_what_batch_one_draws",
            batched=True,
            coupled=True,
        ),
        Path(
            "gamma=auto",
            hs.LAW_CONFIGS["qwen2_5_vl serial chain gamma=auto"],
            "tests/lossless/test_sampling.py",
        ),
        Path(
            "scheduler=auto",
            hs.LAW_CONFIGS["qwen2_5_vl auto chain"],
            "tests/lossless/test_sampling.py (-m matrix; each job runs a stock schedule, checked in the suite)",
        ),
        Path(
            "conversation turn 2",
            hs.SECOND_TURN,
            "tests/lossless/test_conversation.py::test_a_later_turn_draws_what_generate_draws",
            check=hs.second_turn_coupled,
            coupled=True,
        ),
        Path(
            "compiled target",
            hs.COMPILED_TARGET,
            "tests/lossless/test_static.py::test_a_compiled_target_draws_what_the_eager_one_draws",
            coupled=True,
        ),
        Path(
            "process executor",
            hs.LAW_CONFIGS["qwen2_5_vl hippo chain process executor"],
            "tests/lossless/test_sampling.py",
        ),
    )
}

BUGS: tuple[str, ...] = tuple(PLANTED)

#: why a path cannot exercise a planted bug
NO_SIBLINGS = (
    "chains have no siblings: after a rejection the unnormalised residual is only drawn from, and "
    "torch.multinomial normalises it"
)
TREE_DRAFTER = "the path drafts token trees with the tree drafter; the planted drafter is a chain drafter"
BATCH_DRAFTS = (
    "the batch engine draws each row's chain from q itself; a drafter takes part only through "
    "rewrite_chain, which the planted drafter lacks (generate_batch refuses it)"
)

NO_BONUS = (
    "the path draws no bonus token: after a fully accepted drafting p's last row checks the next "
    "drafting's first token, and settle(bonus=False) drops the verifier's bonus draw"
)


def inert(path: Path, bug: str) -> str | None:
    """Why `path` cannot exercise `bug`, or None."""
    kind, cls = PLANTED[bug]
    if getattr(cls, "siblings", False) and path.chain:
        return NO_SIBLINGS
    if kind == "drafters" and not path.chain:
        return TREE_DRAFTER
    if kind == "drafters" and path.batched:
        return BATCH_DRAFTS
    if bug == "planted_bonus_from_q" and not path.bonus:
        return NO_BONUS
    return None


#: (path, bug) -> why not exercised
INERT: dict[tuple[str, str], str] = {
    (p.name, b): why for p in PATHS.values() for b in BUGS if (why := inert(p, b)) is not None
}
#: the cells the suite runs: every (path, bug) not in INERT
CELLS: list[tuple[str, str]] = [(p, b) for p in PATHS for b in BUGS if (p, b) not in INERT]


@attrs.define
class Cell:
    path: str
    bug: str
    caught: bool = False
    runs: int = 0  # runs until the check failed (or all N)
    look: int | None = None  # 1-based look that rejected; None: caught at once (a P = 0 sequence) or passed
    planned: int = 0  # N
    seconds: float = 0.0
    message: str = ""
    coupled: bool = False  # a coupled path's check (the reference's draws, seed by seed), not a law check

    def describe(self) -> str:
        if not self.caught:
            return f"NOT CAUGHT after {self.runs} runs"
        if self.runs == 0:
            return "caught before sampling (a greedy turn differs from target.generate)"
        if self.coupled:
            return f"caught at seed {self.runs} of {self.planned} (the draws differ from the reference's)"
        if self.look is None:
            return f"caught at once, run {self.runs} (a sequence p cannot emit)"
        return f"caught at look {self.look} ({self.runs} of N = {self.planned} runs)"


def run_cell(path: str, bug: str, seed: int = 0) -> Cell:
    """Run `path`'s law check with planted `bug`; the cell says whether (and when) it was caught."""
    p = PATHS[path]
    kind, _ = PLANTED[bug]
    parts = {"verifier": bug} if kind == "verifiers" else {"drafter": bug}
    cell = Cell(path, bug, coupled=p.coupled)
    start = time.perf_counter()
    with planted_plugin():
        try:
            res = p.run(seed=seed, **parts)
        except LosslessViolation as exc:
            res = exc.result
            cell.caught, cell.message = True, exc.report.summary
            law = res is not None and not p.coupled  # a coupled check has no looks
            if law and res.looks and res.looks[-1] == res.runs and "law is off" in cell.message:
                cell.look = len(res.looks)
        else:
            cell.message = res.summary()
    cell.seconds = time.perf_counter() - start
    if res is not None:
        cell.runs, cell.planned = res.runs, res.planned
    return cell


def table(
    paths: list[str] | None = None, out: Callable[[str], Any] = print
) -> list[Cell]:  # pragma: no cover
    """Run every exercised cell of `paths` (default: all) and print the matrix."""
    cells = []
    out(f"{'path':<20} {'planted bug':<27} result")
    for path in paths or list(PATHS):
        for bug in BUGS:
            why = INERT.get((path, bug))
            if why is not None:
                out(f"{path:<20} {bug:<27} not exercised: {why}")
                continue
            cell = run_cell(path, bug)
            cells.append(cell)
            out(f"{path:<20} {bug:<27} {cell.describe()} [{cell.seconds:.1f} s]")
    caught = sum(c.caught for c in cells)
    out(f"{caught} of {len(cells)} exercised cells caught; {len(INERT)} cells not exercised")
    return cells


if __name__ == "__main__":  # pragma: no cover
    import torch

    torch.set_num_threads(1)
    unknown = [p for p in sys.argv[1:] if p not in PATHS]
    if unknown:
        sys.exit(f"unknown path(s) {unknown}; paths: {', '.join(PATHS)}")
    cells = table(sys.argv[1:] or None)
    sys.exit(0 if all(c.caught for c in cells) else 1)
