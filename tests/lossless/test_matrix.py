"""The planted sampling bugs × the paths with a law check (`hippo.testing.matrix`): each path's law
check, the one the suite passes honestly, catches every planted bug that path exercises.

The default tier runs the greedy-collapse column on every path (a pipeline that never samples: each
law holds at most 0.9 on one sequence, so it is caught at the first look) and every cell of the
coupled paths batched rows and conversation turn 2 (a few seeds each); the other cells carry the
`matrix` mark and run in the second tier (`python -m pytest -m matrix`; a law check's
first look is about 200 runs: together they do not fit the default tier's 12 minutes). Every
exercised cell is asserted caught in one of the two tiers.

A cell stops at its check's first rejection: at once on a sequence the target cannot emit, else at a
look (N/10, 3N/10, N), or on a coupled path at the first seed whose draws differ from the reference's;
so a caught bug costs the runs up to that point. The cells a path cannot exercise
are not tests; they are listed, with the reason, in `hippo.testing.matrix.INERT` (printed by
`python -m hippo.testing.matrix`, which also prints the look at which each cell is caught):

    path                       planted bug                 why not exercised
    (every chain path)         planted_tree_unnormalised   chains have no siblings: the unnormalised
                                                           residual is only drawn from (multinomial normalises)
    token trees                planted_draft_temperature   the tree drafter drafts; the planted one is a chain drafter
    batched rows               planted_draft_temperature   the batch engine drafts (rewrite_chain): generate_batch
                                                           refuses a drafter without one

The reasons that are claims about behaviour are tested below (`test_inert_...`).
"""

from __future__ import annotations

import pytest

from hippo.errors import UnsupportedError
from hippo.testing import models as hm
from hippo.testing import planted
from hippo.testing.matrix import BUGS, CELLS, INERT, NO_SIBLINGS, PATHS, run_cell
from hippo.testing.sampling import DEFAULTS, config_build, generation, sampling_case

PROCESSES = {"process executor"}


#: cells that are exercised but not yet caught: open gaps of the path's law check, kept visible (a
#: strict xfail fails the suite the day the check catches the bug, so the entry must then go)
GAPS: dict[tuple[str, str], str] = {}


#: the column the suite runs on every path; the other cells carry the `matrix` mark, which the
#: suite's default run leaves out (`python -m pytest -m matrix`, or `python -m hippo.testing.matrix`)
IN_SUITE = {"planted_greedy_collapse"}


def _param(path: str, bug: str):
    marks = [pytest.mark.xdist_group("processes")] if path in PROCESSES else []
    if path == "compiled target":  # the compiled tests' worker: the tiny target is compiled there once
        marks.append(pytest.mark.xdist_group("compiled"))
    # a coupled path's cell costs a few seeds; but the compiled target recompiles for the shapes a
    # planted part's rounds take (~40 s), so only its collapse cell runs in the default suite
    if bug not in IN_SUITE and (not PATHS[path].coupled or path == "compiled target"):
        marks.append(pytest.mark.matrix)
    if (path, bug) in GAPS:
        marks.append(pytest.mark.xfail(strict=True, reason=GAPS[(path, bug)]))
    return pytest.param(path, bug, id=f"{path.replace(' ', '_')}-{bug.removeprefix('planted_')}", marks=marks)


PARAMS = [_param(p, b) for p, b in CELLS]


@pytest.mark.parametrize(("path", "bug"), PARAMS)
def test_the_paths_law_check_catches_the_planted_bug(path, bug):
    cell = run_cell(path, bug)
    print(f"{path} / {bug}: {cell.describe()} in {cell.seconds:.1f} s")
    assert cell.caught, f"{path} / {bug}: {cell.describe()}: {cell.message}"


def test_every_cell_is_run_or_says_why_not():
    """Seven planted bugs (the six classic ones and a greedy collapse) on ten paths; every cell is
    run, or listed with its reason."""
    assert len(BUGS) == 7 and "planted_greedy_collapse" in BUGS
    assert len(PATHS) == 10
    assert set(CELLS).isdisjoint(INERT) and len(CELLS) + len(INERT) == len(PATHS) * len(BUGS)
    assert all(why for why in INERT.values())
    # each bug is exercised somewhere; each path exercises every verifier bug its drafting allows
    assert {b for _, b in CELLS} == set(BUGS)
    for path in PATHS:
        assert sum((path, b) in INERT for b in BUGS) <= 2, path


def test_every_exercised_cell_is_caught_in_ci():
    """The suite's two tiers, the default one (CI) and `-m matrix`: every exercised cell is a case of
    the test above in one of them, asserted caught there: none is skipped, none is an expected
    failure (GAPS is empty), and the cells of the two tiers together are every exercised cell."""
    assert not GAPS
    cells = [tuple(p.values) for p in PARAMS]
    assert sorted(cells) == sorted(CELLS) and len(set(cells)) == len(CELLS)
    tiers = {"default": 0, "matrix": 0}
    for p in PARAMS:
        names = {m.name for m in p.marks}
        assert names <= {"matrix", "xdist_group"}, (p.id, names)  # no skip, no xfail
        tiers["matrix" if "matrix" in names else "default"] += 1
    assert tiers["default"] >= len(PATHS) and tiers["matrix"] > 0, tiers


@pytest.mark.parametrize(("path", "bug", "why"), [("pearl", "planted_tree_unnormalised", NO_SIBLINGS)])
def test_inert_a_bug_the_path_cannot_exercise_changes_nothing(path, bug, why):
    """NO_SIBLINGS: on a chain, the unnormalised sibling rule emits the same tokens as the stock
    verifier, seed by seed."""
    assert INERT[(path, bug)] == why
    cfg = PATHS[path].config
    opts = {**DEFAULTS, **{k: v for k, v in cfg.items() if k in DEFAULTS}}
    case = sampling_case(cfg.get("adapter"))
    gen = generation(
        opts["temperature"], opts["top_k"], opts["top_p"], opts["repetition_penalty"], opts["new_tokens"]
    )
    from hippo.testing.drafters import corrupting_plugin

    with corrupting_plugin(), planted.planted_plugin():
        honest = config_build(cfg)(case).build()
        buggy = config_build(cfg, bug)(case).build()
        try:
            rejected = 0
            for seed in range(30):
                a = honest.generate(case.inputs, seed=seed, **gen)
                b = buggy.generate(case.inputs, seed=seed, **gen)
                assert a.sequences.tolist() == b.sequences.tolist(), seed
                rejected += sum(b.stats.rejected_per_round)
            assert rejected > 0  # rejections happened: the residual rule ran
        finally:
            honest.close(), buggy.close()


def test_inert_a_batch_refuses_the_planted_drafter():
    """BATCH_DRAFTS: the batched engine drafts each row itself; a drafter without `rewrite_chain`
    (the planted one) has no batched form, and generate_batch says so."""
    from hippo.testing.drafters import corrupting_plugin

    case = sampling_case()
    with corrupting_plugin(), planted.planted_plugin():
        pipe = case.builder("serial", drafter="planted_draft_temperature").build()
        try:
            with pytest.raises(UnsupportedError, match="no batched form"):
                pipe.generate_batch(
                    [case.inputs, case.inputs], do_sample=True, max_new_tokens=2, seeds=[0, 1]
                )
        finally:
            pipe.close()
    assert hm.tiny_adapters()
