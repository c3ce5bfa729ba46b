"""The `hippo` command: help texts, `plugins --json`, `demo`, and the error contract.

Errors: one line `hippo: error: <message>` on stderr, exit status 2, no traceback unless --debug.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

import hippo
import hippo.cli.demo
import hippo.cli.demo_tiny
import hippo.registry
from hippo.cli.main import main
from hippo.errors import PluginError

SMALL = [
    "--adapter",
    "qwen2_5_vl",
    "--frames",
    "4",
    "--size",
    "56",
    "--max-new-tokens",
    "12",
    "--gamma",
    "3",
    "--keep-ratio",
    "0.25",
]


def generate_tokens(
    adapter: str, frames: int, size: int | None, max_new_tokens: int, seed: int = 0
) -> list[int]:
    """The oracle for the demo: transformers' own `generate` on the demo's target and inputs (the
    same float32 tiny model and synthetic video the demo builds), greedy."""
    cls = hippo.registry.lookup("adapters", adapter)
    target = cls.tiny_model("target", seed=seed, dtype=torch.float32)
    demo = hippo.cli.demo_tiny
    inputs = cls.synthetic_inputs(
        target, demo.synthetic_video(frames, size, seed), demo.TEXT_BEFORE, demo.TEXT_AFTER
    )
    with torch.inference_mode():
        out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code


# ---- help ----------------------------------------------------------------------------------------


def test_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    for word in ("usage: hippo", "plugins", "demo", "--debug", "--version", "hippo: error:"):
        assert word in out


def test_demo_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for opt in (
        "--question",
        "--timeline",
        "--frames",
        "--size",
        "--max-new-tokens",
        "--gamma",
        "--keep-ratio",
        "--seed",
        "--adapter",
        "--json",
        "--debug",
    ):
        assert opt in out
    assert "Exit status 1 if the outputs differ" in " ".join(out.split())


def test_plugins_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["plugins", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--json" in out and "HIPPO_DISABLE_PLUGIN_AUTOLOAD" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hippo {hippo.__version__}"


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code([]) == 2
    assert _exit_code(["frobnicate"]) == 2
    assert _exit_code(["demo", "--frames", "many"]) == 2
    assert "invalid int value" in capsys.readouterr().err


# ---- plugins -------------------------------------------------------------------------------------


def test_plugins_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["plugins"]) == set(hippo.registry.KINDS)
    uniform = next(e for e in data["plugins"]["selectors"] if e["name"] == "uniform")
    assert uniform["builtin"] is True and uniform["distribution"] == "hippo"
    assert uniform["class"] == "hippo.plugins.selectors:UniformSelector"
    assert uniform["source"] == f"built-in (hippo {hippo.__version__})"


# ---- demo ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict]:
    """One real small demo run, shared by the tests below (module scope: stdout captured by hand)."""
    path = tmp_path_factory.mktemp("demo") / "result.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["demo", *SMALL, "--json", str(path)])
    return rc, buf.getvalue(), json.loads(path.read_text())


def test_demo_runs_and_all_outputs_match(small_demo) -> None:
    rc, out, result = small_demo
    assert rc == 0
    assert [r["name"] for r in result["runs"]] == ["autoregressive", "serial", "self-speculation"]
    want = generate_tokens("qwen2_5_vl", 4, 56, 12)  # the oracle, computed here
    assert [r["tokens"] for r in result["runs"]] == [want] * 3
    assert result["transformers_generate"]["tokens"] == want
    assert result["all_identical"] is True
    assert all(r["identical"] for r in result["runs"])
    assert result["transformers_generate"]["identical"] is True
    ref = result["runs"][0]
    assert ref["new_tokens"] == len(ref["tokens"]) > 0
    assert all(r["mat"] >= 1.0 and r["seconds"] > 0 for r in result["runs"])
    assert result["settings"] == {
        "frames": 4,
        "size": 56,
        "max_new_tokens": 12,
        "gamma": 3,
        "keep_ratio": 0.25,
        "seed": 0,
        "repeats": 3,
        "threads": 1,
    }
    assert result["runs"][2]["kept_visual_tokens"] == 2 and result["visual_tokens"] == 8


def test_demo_text_report(small_demo) -> None:
    _, out, result = small_demo
    assert "prompt token ids" in out and f"[{result['video_token_id']} x8]" in out
    for r in result["runs"]:
        assert f"{r['name']} output ({r['new_tokens']} tokens): " in out
    for word in ("MAT", "wall s", "speedup", "all outputs identical: yes"):
        assert word in out


def test_demo_default_self_speculation_accepts_drafts() -> None:
    result = hippo.cli.demo_tiny.run_demo(max_new_tokens=32, repeats=1)
    assert result["all_identical"]
    assert result["runs"][2]["mat"] > 1.0  # the target agrees with itself on a pruned video


@pytest.mark.parametrize("adapter", sorted(hippo.registry.registry("adapters")))
def test_demo_on_every_adapter_with_a_tiny_model(adapter: str) -> None:
    cls = hippo.registry.lookup("adapters", adapter)
    try:
        cls.tiny_model("draft")
    except NotImplementedError:
        pytest.skip(f"adapter {adapter!r} ships no tiny model")
    result = hippo.cli.demo_tiny.run_demo(adapter=adapter, frames=4, max_new_tokens=10, repeats=1)
    assert result["adapter"] == adapter and result["settings"]["size"] >= 112
    want = generate_tokens(adapter, 4, result["settings"]["size"], 10)
    assert [r["tokens"] for r in result["runs"]] == [want] * 3
    assert result["all_identical"]


def test_demo_json_on_stdout(capsys: pytest.CaptureFixture[str], monkeypatch, small_demo) -> None:
    monkeypatch.setattr(hippo.cli.demo_tiny, "run_demo", lambda **kw: small_demo[2])
    assert main(["demo", "--adapter", "qwen2_5_vl", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == small_demo[2]


def test_demo_exits_1_when_an_output_differs(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """The demo's own mismatch detection, run for real: the speculative pipelines' last token is
    made wrong, and the demo must see it, say NO and exit 1."""
    real = hippo.Pipeline.generate

    def off_by_one(self, inputs, **kw):
        out = real(self, inputs, **kw)
        if self.names.get("scheduler") == "autoregressive":
            return out
        seq = out.sequences.clone()  # [1, L + new]
        seq[0, -1] = (seq[0, -1] + 1) % self.target.config.get_text_config().vocab_size
        return attrs.evolve(out, sequences=seq)

    monkeypatch.setattr(hippo.Pipeline, "generate", off_by_one)
    assert main(["demo", *SMALL]) == 1
    out = capsys.readouterr().out
    assert "all outputs identical: NO" in out
    assert sum(line.rstrip().endswith(" NO") for line in out.splitlines()) == 2  # both speculative rows


def test_demo_on_the_trained_pair(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """The default demo, as a new user runs it but shorter: a real clip file, streamed text, identical output."""
    png = tmp_path / "timeline.png"
    assert (
        main(["demo", "--max-new-tokens", "24", "--json", str(tmp_path / "r.json"), "--timeline", str(png)])
        == 0
    )
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["identical"] is True and len(result["hippo"]["tokens"]) == 24
    assert result["clip"]["visual_tokens"] == 576 and Path(result["clip"]["path"]).is_file()
    assert result["text"] and result["text"] in " ".join(out.split())  # the answer was streamed as text
    assert "speedup:" in out and "identical output" in out and "hippo generate --target" in out
    stats = result["hippo"]["stats"]  # auto chose the draft's share of the video and says how much it saw
    assert f"the draft saw {stats['kept_visual_tokens']} of the 576 visual tokens" in out
    assert "keep" in stats["plan"] and "the draft sees as much as it chooses" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the command the demo prints for "the same answer from the command line" runs as printed
    command = shlex.split(result["command"])
    assert command[:2] == ["hippo", "generate"]
    assert main([*command[1:], "--json", str(tmp_path / "g.json")]) == 0
    again = json.loads((tmp_path / "g.json").read_text())
    assert again["tokens"][:24] == result["hippo"]["tokens"] and again["compare_ar"]["identical"] is True


def test_synthetic_video_shape_and_range() -> None:
    video = hippo.cli.demo_tiny.synthetic_video(5, 84, seed=1)
    assert video.shape == (5, 84, 84, 3)
    assert float(video.min()) >= 0.0 and float(video.max()) <= 1.0
    assert float(video[:, 0].min()) == 1.0  # the bright border
    assert not bool((video[0] == video[-1]).all())  # the squares move


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["demo", "--adapter", "qwen2_5_vl", "--size", "50"], "--size must be a positive multiple of 28"),
        (["demo", "--adapter", "qwen2_5_vl", "--keep-ratio", "0"], "--keep-ratio must be in (0, 1]"),
        (["demo", "--adapter", "qwen2_5_vl", "--gamma", "0"], "--gamma must be >= 1"),
        (["demo", "--adapter", "qwen2_5_vl", "--frames", "0"], "--frames must be >= 1"),
        (["demo", "--adapter", "qwen2_5_vl", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["demo", "--keep-ratio", "0"], "--keep-ratio must be in (0, 1]"),
        (["demo", "--gamma", "0"], "--gamma must be an integer >= 1 or 'auto'"),
        (["demo", "--adapter", "qwen2_5_vl", "--gamma", "auto"], "--gamma auto needs the trained pair"),
        (["demo", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["demo", "--question", " "], "--question is empty"),
        (["demo", "--frames", "8"], "--frames and --size apply to the random tiny pairs"),
        (
            ["demo", "--timeline", "/nonexistent-dir/t.png"],
            "--timeline '/nonexistent-dir/t.png': its directory",
        ),
        (["demo", "--adapter", "qwen2_5_vl", "--timeline", "t.png"], "--timeline draws the trained pair"),
    ],
)
def test_bad_demo_options(argv, message, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hippo: error: {message}")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_hippo_error_is_one_line(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    def boom(pm=None):
        raise PluginError("first line\n  second line")

    monkeypatch.setattr(hippo.registry, "inventory", boom)
    assert main(["plugins"]) == 2
    assert capsys.readouterr().err == "hippo: error: first line second line\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["--debug", "demo", "--adapter", "qwen2_5_vl", "--size", "50"],
        ["demo", "--adapter", "qwen2_5_vl", "--size", "50", "--debug"],
    ],
)
def test_debug_shows_the_traceback(argv, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ConfigError" in err
    assert err.rstrip().splitlines()[-1].startswith("hippo: error: --size must be")


def test_json_file_that_cannot_be_written(
    capsys: pytest.CaptureFixture[str], monkeypatch, small_demo
) -> None:
    monkeypatch.setattr(hippo.cli.demo_tiny, "run_demo", lambda **kw: small_demo[2])
    assert main(["demo", "--adapter", "qwen2_5_vl", "--json", str(Path("/nonexistent-dir/x.json"))]) == 2
    assert "cannot write --json file" in capsys.readouterr().err


def test_console_script_error_contract() -> None:
    exe = shutil.which("hippo")
    cmd = [exe] if exe else [sys.executable, "-m", "hippo.cli"]
    proc = subprocess.run(
        [*cmd, "demo", "--adapter", "qwen2_5_vl", "--size", "50"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("hippo: error: --size must be a positive multiple of 28")
    assert "Traceback" not in proc.stderr


def test_ci_and_tox_run_the_readme_test_command() -> None:
    """.ci/run's first pytest line is literally the README's, its second the matrix tier (pytest's exit
    status 5, no tests collected, fails the job under `set -e`); tox runs the same pytest with the
    same profile."""
    root = Path(__file__).parents[1]
    readme = (root / "README.md").read_text()
    line = next(
        ln
        for ln in readme.splitlines()
        if ln.startswith('pip install torch==2.13.0 && pip install -e ".[test]"')
    )
    command = line.split(" && ")[-1]
    assert command == "HYPOTHESIS_PROFILE=ci python -m pytest -q"
    ci = (root / ".ci" / "run").read_text().splitlines()
    assert "set -euo pipefail" in ci
    runs = [ln for ln in ci if "pytest" in ln and not ln.startswith("#")]
    assert runs[0] == command  # the fast tier: the README's command; then the matrix tier, hippo eval's tests
    assert runs[1] == f"{command} -m matrix"
    assert runs[2:] == ['HYPOTHESIS_PROFILE=ci "$eval_env/bin/python" -m pytest -q -n 0 tests/test_eval.py']
    tox = (root / "tox.ini").read_text()
    assert "HYPOTHESIS_PROFILE = ci" in tox and "commands = python -m pytest -q {posargs}" in tox


def test_readme_and_docs_links_resolve() -> None:
    """Every relative link of README.md and docs/*.md names a file that exists and, after a `#`, one
    of its headings (GitHub's anchor: lower case, punctuation dropped, spaces as hyphens)."""
    import re

    root = Path(__file__).parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    assert len(pages) > 1
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.is_file():
                broken.append(f"{page.name}: {target}")
            elif anchor:
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
                if anchor not in slugs:
                    broken.append(f"{page.name}: {target}")
    assert not broken, f"links to nothing: {broken}"
