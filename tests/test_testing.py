"""hippo.testing, the public lossless harness: it catches a lossy plugin (in Python and with
`hippo check`), passes correct ones, reports what a person needs, and fails cleanly on bad input.

The lossy plugin is tests/fixtures/lossy (a scheduler that, in a rare state, emits a draft token
without verifying it, and a rejection verifier that draws the recovered token from p); it is
registered at runtime here, and installed for real in one subprocess test (where `hippo check
--sampling` must exit 1 on the broken verifier and 0 on its fixed twin), together with the
third-party example package and its own test suite. The seven planted sampling bugs of
`hippo.testing.planted` must each fail the law test and `hippo check NAME --sampling` (and each path's
law check: tests/lossless/test_matrix.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from installed import GROUP, subprocess_env

import hippo
from hippo.cli.main import main
from hippo.errors import ConfigError, PluginError
from hippo.testing import (
    Case,
    LosslessViolation,
    assert_greedy_lossless,
    assert_sampling_exact,
    check_plugin,
    plugin_build,
    replay_greedy,
)
from hippo.testing._deps import MissingTestingDependency, require_hypothesis
from hippo.testing.planted import PLANTED, planted_build, planted_plugin
from hippo.testing.plugin_check import sampling_plan

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES / "lossy"))
import hippo_lossy_example  # noqa: E402

LOSSY = "lossy_skip_verify"
ADAPTER = "qwen2_5_vl"


@pytest.fixture
def lossy_plugin():
    pm = hippo.plugin_manager()
    pm.register(hippo_lossy_example, name="hippo-tests-lossy")
    try:
        yield
    finally:
        pm.unregister(plugin=hippo_lossy_example)


def test_assert_greedy_lossless_catches_the_lossy_scheduler(lossy_plugin):
    def build(case):
        return case.builder(LOSSY)

    with pytest.raises(LosslessViolation) as info:
        assert_greedy_lossless(build, adapters=ADAPTER, examples=10, seed=0, shrink=False)
    r = info.value.report
    print(r.format())
    assert r.check == "greedy" and r.position is not None and r.got != r.want
    assert r.got_tokens[: r.position] == r.want_tokens[: r.position]
    assert f"adapter={ADAPTER}" in r.case and "γ=" in r.case and "keep_ratio=" in r.case and "seed=" in r.case
    assert r.parts["scheduler"] == LOSSY
    assert "replay_greedy(" in r.reproduce and "Case(adapter=" in r.reproduce
    with pytest.raises(LosslessViolation):  # the reported counterexample reproduces
        replay_greedy(build, r.counterexample)


def test_hippo_check_catches_the_lossy_scheduler_and_reproduces(lossy_plugin, capsys):
    rc = main(["check", LOSSY, "--examples", "10", "--adapter", ADAPTER, "--no-shrink"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 1
    assert "greedy check FAILED" in out and "first difference at generated position" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("reproduce:"))
    code = line.split('python -c "', 1)[1].rstrip('"')
    with pytest.raises(LosslessViolation):  # the one-line snippet runs the counterexample again
        exec(code, {})


def test_correct_parts_pass(capsys):
    assert main(["check", "serial", "--kind", "scheduler", "--examples", "3", "--adapter", ADAPTER]) == 0
    out = capsys.readouterr().out
    assert (
        "greedy: lossless on 4 examples" in out and "OK: scheduler 'serial'" in out
    )  # 3 drawn + the fixed partial case
    res = check_plugin("topk", examples=2, adapters=[ADAPTER])
    assert res.status == 0 and res.kind == "selectors", res.text()


@pytest.mark.parametrize(
    "name, kind", [("holistic", None), ("rejection", None), ("chain", None), ("simulated", None)]
)
def test_hippo_check_builds_each_kind_with_the_parts_it_needs(name, kind):
    res = check_plugin(name, kind, examples=1, adapters=[ADAPTER])
    assert res.status == 0, res.text()


def test_reproduction_of_a_passing_case():
    case = Case(
        ADAPTER, (2, 56, 56), (5, 6), (7,), draft="self", gamma=3, wrong=(False, True), max_new_tokens=9
    )
    out = replay_greedy(plugin_build("schedulers", "serial"), case)
    assert out.stats.new_tokens == 9


def test_hippo_check_bad_usage(capsys):
    assert main(["check", "no_such_part"]) == 2
    assert "no part named 'no_such_part' is installed" in capsys.readouterr().err
    assert main(["check", "serial", "--kind", "selector"]) == 2
    assert "no selector named 'serial'" in capsys.readouterr().err
    assert main(["check", "serial", "--examples", "0"]) == 2


class _NeedsOptions(hippo.Scheduler):
    import attrs as _attrs

    @_attrs.frozen
    class Config:
        period: int
        gamma: int = 2

    def run(self, job):  # pragma: no cover - never built
        raise AssertionError


class _OptionsPlugin:
    @hippo.hookimpl
    def hippo_register_schedulers(self):
        return {"needs_period": _NeedsOptions}


class _RaisingHookPlugin:
    @hippo.hookimpl
    def hippo_register_schedulers(self):
        raise RuntimeError("boom in the hook")


@pytest.mark.parametrize(
    "plugin, args, message",
    [
        (_OptionsPlugin(), ["needs_period"], "option(s) period have no default"),
        (
            _RaisingHookPlugin(),
            ["serial"],
            "the hippo_register_schedulers hook of runtime plugin 'extra' raised",
        ),
    ],
)
def test_hippo_check_refuses_unbuildable_or_broken_plugins(plugin, args, message, capsys):
    pm = hippo.plugin_manager()
    pm.register(plugin, name="extra")
    try:
        assert main(["check", *args, "--examples", "1"]) == 2
    finally:
        pm.unregister(plugin=plugin)
    assert message in capsys.readouterr().err


def test_missing_hypothesis_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    with pytest.raises(MissingTestingDependency, match=r"pip install 'hippo\[testing\]'"):
        require_hypothesis()
    assert main(["check", "serial"]) == 2


def test_bad_adapter_is_a_config_error():
    with pytest.raises(ConfigError, match="no tiny model for adapter"):
        assert_greedy_lossless(lambda case: case.builder(), adapters="nope", examples=1)
    with pytest.raises(PluginError):
        check_plugin("nope")


# ---- the law test: seven planted sampling bugs, each caught; the honest verifiers pass ---------------

ALL_PLANTED = sorted(PLANTED)
#: Planted bugs that are exact under greedy decoding: `hippo check` passes their greedy stage and its
#: law stage (`assert_sampling_exact`, the same call) must catch them.
SAMPLING_ONLY = (
    "planted_draft_temperature",
    "planted_greedy_collapse",
    "planted_residual_from_p",
    "planted_tree_unnormalised",
)


def test_seven_planted_bugs():
    kinds = {kind for kind, _ in PLANTED.values()}
    assert len(PLANTED) == 7 and kinds == {"verifiers", "drafters"} and set(SAMPLING_ONLY) < set(PLANTED)


def test_a_flat_draft_is_the_target_with_halved_logits():
    """The tree law checks' draft (TREE_SETTINGS, `models.flat_draft`): q from the target's logits
    halved, so q ranks tokens as p does but is flatter; the target itself is untouched."""
    import torch

    from hippo.testing import models as hm
    from hippo.testing.sampling import TREE_SETTINGS, sampling_case

    case = sampling_case(ADAPTER, draft=TREE_SETTINGS["draft"])
    target, draft = case.target, case.draft_model
    assert draft is not target and draft is hm.flat_draft(ADAPTER)
    with torch.no_grad():
        p_logits = target(**case.inputs).logits[0, -1]
        q_logits = draft(**case.inputs).logits[0, -1]
        again = target(**case.inputs).logits[0, -1]
    torch.testing.assert_close(q_logits, hm.FLAT_SCALE * p_logits)
    assert torch.equal(again, p_logits)
    assert q_logits.argsort(descending=True)[:3].tolist() == p_logits.argsort(descending=True)[:3].tolist()


@pytest.mark.parametrize("name", [n for n in ALL_PLANTED if n not in SAMPLING_ONLY])
def test_the_law_test_catches_the_planted_bug(name):
    """A planted bug that greedy decoding also sees fails `assert_sampling_exact` by itself (the others
    fail it inside `hippo check`, below, which runs the same call after its greedy stage)."""
    with planted_plugin():
        with pytest.raises(LosslessViolation) as info:
            assert_sampling_exact(planted_build(name), adapter=ADAPTER)
    report = info.value.report
    print(report.format())
    assert report.check == "sampling" and "assert_sampling_exact(" in report.reproduce


def _check_param(name: str):
    # a tree verifier's first law stage is the tree one, which catches the residual bug only at its
    # last look (all N runs, ~50 s); CI sees `hippo check` catch that bug class through the installed
    # third-party `lossy_residual_from_p` (test_installed_plugins_...), so this cell runs with the matrix
    marks = [pytest.mark.matrix] if name == "planted_residual_from_p" else []
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_check_param(n) for n in ALL_PLANTED])
def test_hippo_check_catches_the_planted_bug(name, capsys):
    """Exit 1 on every planted bug; the ones exact under greedy pass the greedy stage and fail the law
    (a tree verifier first with TREE_SETTINGS, where siblings are tested)."""
    with planted_plugin():
        rc = main(["check", name, "--sampling", "--examples", "2", "--adapter", ADAPTER, "--no-shrink"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 1, out
    if name in SAMPLING_ONLY:
        assert "greedy: lossless" in out and "sampling check FAILED" in out, out
    else:
        assert "check FAILED" in out


@pytest.mark.parametrize(
    ("kind", "name", "plan"),
    [
        ("verifiers", "rejection", ["token trees", "default", "conversation turn 2"]),
        ("verifiers", "planted_residual_from_p", ["token trees", "default", "conversation turn 2"]),
        ("drafters", "chain", ["default", "conversation turn 2"]),
        ("drafters", "tree", ["token trees", "default"]),
        ("schedulers", "serial", ["default", "conversation turn 2"]),
        ("selectors", "topk", ["default"]),
    ],
)
def test_hippo_check_runs_the_law_on_more_than_one_configuration(kind, name, plan):
    """`hippo check --sampling` holds a scheduler, drafter or verifier to the paths of the planted-bug
    matrix it can take part in, targeted ones first; the honest runs of each are tests/lossless (the
    stock parts) and the installed twin below (`fixed_chain`)."""
    with planted_plugin():
        assert sampling_plan(kind, name) == plan


def test_hippo_check_names_the_law_check_that_failed(lossy_plugin, capsys):
    """A held-out drafter bug (q reported before the logits processors: exact under greedy) is caught
    by the first law check of the drafter's plan, the default case, and the output names that check."""
    rc = main(
        ["check", "lossy_unwarped_q", "--sampling", "--examples", "1", "--adapter", ADAPTER, "--no-shrink"]
    )
    out = capsys.readouterr().out
    print(out)
    assert rc == 1 and "greedy: lossless" in out, out
    assert "sampling: the law on 2 configurations: default, conversation turn 2" in out
    assert "the law check on the default case FAILED" in out


@pytest.mark.parametrize(
    ("args", "messages"),
    [
        (["--law", "default"], ["--law picks the law checks of --sampling: add --sampling"]),
        (
            ["--sampling", "--law", "token trees"],
            [
                "--law 'token trees' is not a law check of scheduler 'serial'",
                "'default', 'conversation turn 2'",
            ],
        ),
    ],
)
def test_hippo_check_law_names_a_configuration_of_the_plan(args, messages, capsys):
    """`--law` runs the law on some of the part's configurations; one outside its plan is bad usage."""
    assert main(["check", "serial", *args, "--examples", "1", "--adapter", ADAPTER]) == 2
    err = capsys.readouterr().err
    assert all(m in err for m in messages), err


# ---- installed for real: the lossy package and the third-party package with its own suite -------------


@GROUP
def test_installed_plugins_with_hippo_check_and_their_own_suite(installed_fixtures):
    env = subprocess_env(installed_fixtures)
    env.pop("HIPPO_DISABLE_PLUGIN_AUTOLOAD", None)
    hippo_cli = [sys.executable, "-m", "hippo.cli"]
    raising = subprocess.run(
        [*hippo_cli, "check", "lossy_raising", "--examples", "1", "--adapter", ADAPTER],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert raising.returncode == 1, raising.stdout + raising.stderr
    assert "scheduler 'lossy_raising' from hippo-lossy-example 0.1.0 raised RuntimeError" in raising.stdout
    # a verifier whose only bug is the residual (drawn from p): exact under greedy, caught in law; the
    # held-out drafter's fixed twin passes the default case's law check at full power (its bug,
    # `lossy_unwarped_q`, is caught in process above: test_hippo_check_names_the_law_check_that_failed;
    # the conversation's turn 2 draws what `generate` draws: tests/lossless/test_conversation.py)
    runs = (("lossy_residual_from_p", 1, "verifier"), ("fixed_chain", 0, "drafter"))
    for name, status, kind in runs:
        check = subprocess.run(
            [*hippo_cli, "check", name, "--sampling", "--law", "default", "--examples", "1"]
            + ["--adapter", ADAPTER, "--no-shrink"],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert check.returncode == status, check.stdout + check.stderr
        assert f"{kind} {name!r} from hippo-lossy-example 0.1.0" in check.stdout
        assert ("sampling check FAILED" in check.stdout) == (status == 1), check.stdout
        assert "sampling: the law on 1 configuration: default" in check.stdout, check.stdout
    # the third party's own suite, on the public API and the pytest plugin's --hippo-examples
    suite = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hippo-examples", "2", "tests"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=installed_fixtures.parent / "thirdparty",  # the copy it was installed from
    )
    assert suite.returncode == 0, suite.stdout[-3000:] + suite.stderr[-3000:]
    assert "2 passed" in suite.stdout


def test_readme_shows_the_third_party_suite():
    """docs/plugins.md's "Prove your plugin lossless" test (linked from the README) is the example
    package's own suite, word for word."""
    import re

    guide = (Path(__file__).parents[1] / "docs" / "plugins.md").read_text()
    section = guide[guide.index("## Prove your plugin lossless") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    suite = (FIXTURES / "thirdparty" / "tests" / "test_lossless.py").read_text()
    assert code.strip() == suite[suite.index("from hippo.testing") :].strip()
