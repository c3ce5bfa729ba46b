"""`hippo chat`: one prepared video, many questions, each answer what the target's `generate` gives.

The tiny checkpoint pair of tests/tiny_checkpoint.py; the interactive session is driven through its
standard input, as a person types (end of input quits like /quit).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import hippo
from hippo.cli.main import main
from hippo.media.inputs import load_video_inputs

pytest.importorskip("av")
from tiny_checkpoint import save_checkpoint, write_video  # noqa: E402


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("chat")
    return {
        # float64: each answer is compared with target.generate exactly
        "target": str(save_checkpoint(root / "target", dtype=torch.float64)),
        "draft": str(save_checkpoint(root / "draft", role="draft", seed=1, dtype=torch.float64)),
        "video": str(write_video(root / "v.mp4", n=16, fps=8, size=(64, 64))),
    }


def common(env: dict[str, str]) -> list[str]:
    return [
        "--target", env["target"], "--draft", env["draft"], "--video", env["video"], "--frames", "4",
        "--max-pixels", "3136", "--max-new-tokens", "8", "--scheduler", "hippo", "--gamma", "3", "--keep-ratio", "0.25", "--no-progress",
    ]  # fmt: skip


def test_questions_file_answers_each_like_generate(env, tmp_path, capsys) -> None:
    qs = ["describe the video .", "what moves ?"]
    (tmp_path / "q.txt").write_text(f"{qs[0]}\n\n  {qs[1]}  \n")
    assert (
        main(
            ["chat", *common(env), "--questions", str(tmp_path / "q.txt"), "--json", str(tmp_path / "c.json")]
        )
        == 0
    )
    out = capsys.readouterr().out
    answers = json.loads((tmp_path / "c.json").read_text())["answers"]
    assert [a["question"] for a in answers] == qs and f"Q: {qs[1]}" in out
    # no history between them: each answer is transformers' generate on that question's inputs
    target = hippo.PipelineBuilder().target(env["target"]).scheduler("autoregressive").build()
    assert target.target.dtype == torch.float64
    for q, a in zip(qs, answers):
        inputs = load_video_inputs(target.target_adapter, env["video"], q, frames=4, max_pixels=3136)
        with torch.inference_mode():
            ref = target.target.generate(**inputs, max_new_tokens=8, do_sample=False)
        assert a["tokens"] == ref[0, inputs["input_ids"].shape[1] :].tolist()
        assert a["text"] in " ".join(out.split())  # streamed


def test_interactive_session_through_stdin(env, tmp_path) -> None:
    exe = shutil.which("hippo")
    cmd = [exe] if exe else [sys.executable, "-m", "hippo.cli"]
    long_question = "red " * 4100  # longer than the tiny target's context: reported, the session goes on
    typed = f"describe the video .\n\n/stats\n{long_question}\nwhat moves ?\n/reset\n/nonsense\n/quit\n"
    proc = subprocess.run(
        [*cmd, "chat", *common(env), "--json", str(tmp_path / "c.json")],
        input=typed,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "/stats, /reset" in proc.stdout and "video prepared once in" in proc.stdout
    assert "questions answered: 1" in proc.stdout  # /stats after the first answer
    assert "context is" in proc.stderr and "Traceback" not in proc.stderr  # the long question
    assert "earlier turns forgotten" in proc.stdout and "unknown command '/nonsense'" in proc.stdout
    answers = json.loads((tmp_path / "c.json").read_text())["answers"]
    assert [("error" in a) for a in answers] == [False, True, False]
    assert answers[2]["stats"]["new_tokens"] >= 1


@pytest.mark.parametrize("content,message", [(None, "is not a file"), ("\n  \n", "has no questions")])
def test_bad_questions_file(env, tmp_path, capsys, content, message) -> None:
    path = tmp_path / "q.txt"
    if content is not None:
        path.write_text(content)
    assert main(["chat", *common(env), "--questions", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hippo: error: --questions") and message in err
