"""Plugin discovery: a real third-party distribution, duplicate names, misspelled hooks, `hippo plugins`.

The third-party package (tests/fixtures/thirdparty) is installed for real with
`pip install --target <tmpdir>` once per session (with tests/fixtures/lossy, for tests/test_testing.py:
the `installed_fixtures` fixture, whose tests share one xdist worker) and exercised in subprocesses
with PYTHONPATH=<tmpdir>, so the test environment itself never changes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from installed import GROUP, subprocess_env

import hippo
from hippo.cli.main import main
from hippo.errors import PluginError
from hippo.interfaces import Scheduler, Selector
from hippo.registry import (
    AUTOLOAD_ENV,
    build_plugin_manager,
    check,
    describe,
    lookup,
    plugin_manager,
    registry,
)

FIXTURE = Path(__file__).parent / "fixtures" / "thirdparty"
DIST = "hippo-thirdparty-example"
SCORER, SCHEDULER = "example_norm", "example_alternating"


@pytest.fixture(scope="session")
def thirdparty_site(installed_fixtures: Path) -> Path:
    """The fixture distribution installed into a private directory (`installed_fixtures`, with the
    lossy example beside it: tests/installed.py)."""
    assert list(installed_fixtures.glob("hippo_thirdparty_example-*.dist-info")), "pip installed no dist-info"
    return installed_fixtures


def _run(site: Path, script: str, *, autoload: bool) -> dict:
    env = {k: v for k, v in subprocess_env(site).items() if k != AUTOLOAD_ENV}
    if not autoload:
        env[AUTOLOAD_ENV] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


USE_PLUGINS = """
    import contextlib, io, json
    import attrs
    import torch
    import hippo
    from hippo.cli.main import main
    from hippo.registry import describe, lookup, registry

    out = {"describe": describe()}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out["cli_rc"] = main(["plugins", "--json"])
    out["cli"] = json.loads(buf.getvalue())

    scorer_cls = lookup("scorers", "example_norm")
    calls = []
    original = scorer_cls.score
    def counting(self, visual, context):
        calls.append(visual.n)
        return original(self, visual, context)
    scorer_cls.score = counting

    # a selector that ranks by score when one is installed (topk first), else uniform (the scorer
    # still runs); keep_ratio only where the selector takes it
    selectors = registry("selectors")
    ranking = sorted((n != "topk", n) for n, (cls, _) in selectors.items() if cls.needs_scores)
    selector = ranking[0][1] if ranking else "uniform"
    config = getattr(selectors[selector][0], "Config", None)
    fields = {a.name for a in attrs.fields(config)} if config is not None and attrs.has(config) else set()
    options = {"keep_ratio": 0.5} if "keep_ratio" in fields else {}

    A = lookup("adapters", "qwen2_5_vl")
    target = A.tiny_model("target", seed=0, dtype=torch.float64)
    draft = A.tiny_model("draft", seed=1, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    inputs = A.synthetic_inputs(target, torch.rand(4, 56, 56, 3, generator=g), [1, 17, 42], [61, 19])
    L = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        ref = target.generate(**inputs, max_new_tokens=20, do_sample=False)
    out["runs"] = []
    for name, d in (("tiny draft", draft), ("self", target)):
        pipe = (
            hippo.PipelineBuilder().target(target).draft(d)
            .scorer("example_norm").selector(selector, **options)
            .scheduler("example_alternating", short=1, long=3)
            .build()
        )
        res = pipe.generate(inputs, max_new_tokens=20, do_sample=False)
        out["runs"].append({
            "draft": name,
            "equal": bool(torch.equal(res.sequences, ref)),
            "tokens": res.sequences[0, L:].tolist(),
            "reference": ref[0, L:].tolist(),
            "gammas": res.stats.drafted_per_round,
            "names": pipe.names,
        })
    out["scorer_calls"] = calls
    out["selector"] = selector
    print(json.dumps(out))
"""

WITHOUT_PLUGINS = """
    import json
    import hippo
    from hippo.errors import PluginError
    from hippo.registry import describe

    out = {"describe": describe(), "errors": {}}
    for kind, name in (("scorer", "example_norm"), ("scheduler", "example_alternating")):
        try:
            getattr(hippo.PipelineBuilder(), kind)(name)
        except PluginError as exc:
            out["errors"][kind] = str(exc)
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def with_plugins(thirdparty_site: Path) -> dict:
    return _run(thirdparty_site, USE_PLUGINS, autoload=True)


@GROUP
def test_thirdparty_parts_are_listed_with_their_distribution(with_plugins: dict) -> None:
    desc = with_plugins["describe"]
    assert desc["scorers"][SCORER] == f"{DIST} 0.1.0"
    assert desc["schedulers"][SCHEDULER] == f"{DIST} 0.1.0"
    assert desc["schedulers"]["serial"].startswith("built-in (hippo ")  # built-ins still there
    assert with_plugins["cli_rc"] == 0
    entries = {e["name"]: e for e in with_plugins["cli"]["plugins"]["schedulers"]}
    assert entries[SCHEDULER]["distribution"] == DIST
    assert entries[SCHEDULER]["version"] == "0.1.0"
    assert entries[SCHEDULER]["builtin"] is False
    assert entries[SCHEDULER]["class"] == "hippo_thirdparty_example:AlternatingScheduler"
    assert with_plugins["cli"]["autoload"] is True


@GROUP
def test_thirdparty_parts_generate_the_targets_output(with_plugins: dict) -> None:
    assert with_plugins["scorer_calls"], "the plugin scorer was never called"
    for run in with_plugins["runs"]:
        assert run["names"]["scorer"] == SCORER and run["names"]["scheduler"] == SCHEDULER
        assert run["names"]["selector"] == with_plugins["selector"]
        assert run["equal"], f"{run['draft']}: {run['tokens']} != target.generate {run['reference']}"
        gammas = run["gammas"]
        assert gammas, "no speculative rounds ran"
        # γ alternates short, long, short, ...; only the last rounds may be cut by the token budget
        pattern = [(1, 3)[i % 2] for i in range(len(gammas))]
        cut = [i for i, (g, want) in enumerate(zip(gammas, pattern)) if g != want]
        assert all(gammas[i] < pattern[i] and i >= len(gammas) - 3 for i in cut), gammas
        assert len(cut) < len(gammas) // 2, gammas


@GROUP
def test_disabled_autoload_hides_thirdparty_parts(thirdparty_site: Path) -> None:
    out = _run(thirdparty_site, WITHOUT_PLUGINS, autoload=False)
    assert SCORER not in out["describe"]["scorers"]
    assert SCHEDULER not in out["describe"]["schedulers"]
    assert "serial" in out["describe"]["schedulers"]
    sched = out["errors"]["scheduler"]
    assert f"unknown scheduler '{SCHEDULER}'" in sched
    assert "autoregressive" in sched and "serial" in sched  # lists the known ones
    assert f"unknown scorer '{SCORER}'" in out["errors"]["scorer"]


# ---- in-process: fresh, uncached plugin managers --------------------------------------------------


class DuplicateUniform:
    """Registers a second selector under the built-in name 'uniform'."""

    @staticmethod
    @hippo.hookimpl
    def hippo_register_selectors():
        return {"uniform": Selector}


class MisspelledHook:
    @staticmethod
    @hippo.hookimpl
    def hippo_register_scorer():  # the hook is hippo_register_scorers
        return {}


class BadReturn:
    @staticmethod
    @hippo.hookimpl
    def hippo_register_schedulers():
        return ["not", "a", "dict"]


class EveryOther(Scheduler):
    needs_draft = False

    def run(self, job) -> None:  # pragma: no cover - never run
        raise NotImplementedError


class RuntimeScheduler:
    @staticmethod
    @hippo.hookimpl
    def hippo_register_schedulers():
        return {"runtime_example": EveryOther}


def test_build_plugin_manager_is_fresh_and_plugin_manager_is_cached() -> None:
    assert plugin_manager() is plugin_manager()
    fresh = build_plugin_manager()
    assert fresh is not plugin_manager() and fresh is not build_plugin_manager()
    assert set(registry("selectors", fresh)) >= {"full", "uniform", "random"}


def test_duplicate_name_names_both_sources() -> None:
    pm = build_plugin_manager(autoload=False, plugins=[DuplicateUniform])
    with pytest.raises(PluginError) as info:
        registry("selectors", pm)
    msg = str(info.value)
    assert "'uniform' is registered twice" in msg
    assert "built-in (hippo " in msg and "runtime plugin 'DuplicateUniform'" in msg
    with pytest.raises(PluginError, match="registered twice"):
        hippo.PipelineBuilder(pm).selector("uniform")


def test_misspelled_hookimpl_is_a_plugin_error() -> None:
    with pytest.raises(PluginError) as info:
        build_plugin_manager(autoload=False, plugins=[MisspelledHook])
    msg = str(info.value)
    assert "hippo_register_scorer" in msg and "MisspelledHook" in msg
    assert "hippo_register_scorers" in msg  # the valid hook names are listed

    pm = build_plugin_manager(autoload=False)
    pm.register(MisspelledHook)
    with pytest.raises(PluginError, match="hippo_register_scorer"):
        check(pm)


def test_register_hook_must_return_a_dict() -> None:
    pm = build_plugin_manager(autoload=False, plugins=[BadReturn])
    with pytest.raises(PluginError, match="must return a dict"):
        registry("schedulers", pm)


def test_runtime_plugin_through_the_builder() -> None:
    pm = build_plugin_manager(autoload=False, plugins=[RuntimeScheduler])
    assert lookup("schedulers", "runtime_example", pm) is EveryOther
    assert describe(pm)["schedulers"]["runtime_example"] == "runtime plugin 'RuntimeScheduler'"
    hippo.PipelineBuilder(pm).scheduler("runtime_example")  # resolves through the given manager
    with pytest.raises(PluginError, match="unknown scheduler 'runtime_example'"):
        hippo.PipelineBuilder(build_plugin_manager(autoload=False)).scheduler("runtime_example")


def test_autoload_env_var_is_read_when_building(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    pm = build_plugin_manager()
    assert all(o.builtin for o in pm.origins.values())
    assert {"builtin-selectors", "builtin-schedulers"} <= set(pm.origins)


def test_hippo_plugins_lists_the_builtins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for kind in ("scorers:", "selectors:", "drafters:", "verifiers:", "schedulers:", "adapters:"):
        assert kind in out
    for name in ("uniform", "random", "full", "chain", "greedy", "rejection", "autoregressive", "serial"):
        line = next((ln for ln in out.splitlines() if ln.split()[:1] == [name]), None)
        assert line is not None, f"{name} missing from `hippo plugins`:\n{out}"
        assert "built-in (hippo " in line
    assert "qwen2_5_vl" in out and "hippo.adapters.qwen2_5_vl:Qwen25VLAdapter" in out


def test_readme_plugin_example_is_the_fixture() -> None:
    """docs/plugins.md's 'complete third-party plugin' (linked from the README) is this tested
    fixture, word for word."""
    import re

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    guide = (Path(__file__).parents[1] / "docs" / "plugins.md").read_text()
    section = guide[guide.index("## A complete third-party plugin") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    fixture = (FIXTURE / "hippo_thirdparty_example" / "__init__.py").read_text()
    assert code[code.index("import attrs") :] == fixture[fixture.index("import attrs") :]
    shown = tomllib.loads(re.search(r"```toml\n(.*?)```", section, re.S).group(1))
    real = tomllib.loads((FIXTURE / "pyproject.toml").read_text())
    assert shown["build-system"] == real["build-system"]
    assert shown["tool"] == real["tool"]
    for key in ("name", "version", "dependencies", "entry-points"):
        assert shown["project"][key] == real["project"][key]


def test_readme_minimal_plugin_is_the_fixtures_own() -> None:
    """The README's minimal plugin is the tested fixture's: its entry point, its imports, and each
    class and function it shows, word for word; and it registers what it defines."""
    import ast
    import re

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("## Plugins") :]
    section = section[: section.index("\n## ", 1)]
    shown = tomllib.loads(re.search(r"```toml\n(.*?)```", section, re.S).group(1))
    real = tomllib.loads((FIXTURE / "pyproject.toml").read_text())
    assert shown == {"project": {"entry-points": real["project"]["entry-points"]}}
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    fixture = (FIXTURE / "hippo_thirdparty_example" / "__init__.py").read_text()
    ours = {n.name: ast.get_source_segment(fixture, n) for n in ast.parse(fixture).body if hasattr(n, "name")}
    tree = ast.parse(code)
    defs = [n for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef)]
    assert [n.name for n in defs] == ["NormScorer", "hippo_register_scorers"]
    for n in defs:
        assert ast.get_source_segment(code, n) == ours[n.name], n.name
    imports = [ast.unparse(n) for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert imports and all(f"\n{line}\n" in f"\n{fixture}" for line in imports)
    assert len(tree.body) == len(defs) + len(imports)  # nothing else
    namespace: dict = {}
    exec(compile(tree, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    assert namespace["hippo_register_scorers"]() == {"example_norm": namespace["NormScorer"]}


def test_overriding_scheduler_run_is_deprecated_and_still_runs() -> None:
    """A schedule written against the old protocol (its own `run` loop) warns when it is defined and
    still decodes through `Pipeline.generate`, equal to the target's own greedy output."""
    import warnings

    import torch

    from hippo.adapters.qwen2_5_vl_tiny import synthetic_inputs, tiny_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        class OwnLoop(Scheduler):
            def run(self, job) -> None:
                target = job.prefill_target()
                job.first_token(target)
                draft = job.prefill_draft() if not job.done else None
                while not job.done:
                    proposal = job.pipeline.drafter.propose(draft, job.prefix(), 2, job.policy)
                    job.verify_round(target, proposal)

    (warning,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert "OwnLoop overrides Scheduler.run" in str(warning.message) and "batch_gamma" in str(warning.message)
    assert not OwnLoop.batches  # no policy: decoded one request at a time
    target = tiny_model("target", seed=0, dtype=torch.float64)
    inputs = synthetic_inputs(
        target, torch.rand(2, 56, 56, 3, generator=torch.Generator().manual_seed(0)), [1, 5, 6], [7]
    )

    class OwnLoopPlugin:
        @staticmethod
        @hippo.hookimpl
        def hippo_register_schedulers():
            return {"own_loop": OwnLoop}

    pm = hippo.plugin_manager()
    pm.register(OwnLoopPlugin, name="test-own-loop")
    try:
        pipe = hippo.PipelineBuilder().target(target).draft(target).scheduler("own_loop").build()
        out = pipe.generate(inputs, max_new_tokens=8, do_sample=False)
    finally:
        pm.unregister(OwnLoopPlugin)
    assert torch.equal(out.sequences, target.generate(**inputs, max_new_tokens=8, do_sample=False))
    assert sum(out.stats.accepted_per_round) > 0


def test_a_policy_only_schedule_has_no_deprecation_and_batches() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class Fixed(Scheduler):
            def batch_gamma(self, job, rows: int) -> int:
                return 2

    assert Fixed.batches


def test_a_drafter_with_its_own_propose_does_not_inherit_plain_chains():
    """The batch engine draws a batch's chains itself only for a drafter that promises plain chains
    (`Drafter.plain_chains`, the `chain` drafter's): a subclass that drafts its own way (its own
    `propose`) has no batched form unless it says so, one that keeps the chain's `propose` keeps it."""
    from hippo.engine import chain_rewrite
    from hippo.plugins.drafters import ChainDrafter

    class Renamed(ChainDrafter):
        pass

    class OwnWay(ChainDrafter):
        def propose(self, session, prefix, gamma, policy, should_stop=None):
            return super().propose(session, prefix, gamma, policy, should_stop)

    class OwnWayPlain(OwnWay):
        plain_chains = True

    assert ChainDrafter.plain_chains and Renamed.plain_chains and OwnWayPlain.plain_chains
    assert not OwnWay.plain_chains and not hippo.Drafter.plain_chains
    assert chain_rewrite(ChainDrafter()) is not None and chain_rewrite(Renamed()) is not None
    assert chain_rewrite(OwnWay()) is None
