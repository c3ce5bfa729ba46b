"""`hippo batch IN.jsonl OUT.jsonl` end to end on tiny checkpoints (float64), in-process and on Ray.

Every answer must be the target's own `generate` on that record alone; a re-run after a kill must
lose no row and answer none twice; a bad record must get an error line with the message `hippo
generate` prints for the same input, with exit status 1; bad usage exits 2 before any decoding.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

import hippo
from hippo.adapters.qwen2_5_vl_tiny import tiny_config
from hippo.cli.main import main
from hippo.media.inputs import load_tokenizer, load_video_inputs
from hippo.registry import lookup

pytest.importorskip("av")
from tiny_checkpoint import save_checkpoint, tiny_tokenizer, write_video  # noqa: E402

FLAGS = [
    "--dtype",
    "float64",
    "--max-pixels",
    "3136",
    "--max-new-tokens",
    "8",
    "--scheduler",
    "serial",
    "--gamma",
    "3",
]
SUMMARY = re.compile(
    r"^hippo batch: (\d+) answered, (\d+) failed, (\d+) already in OUT; \d+ new tokens in [\d.]+ s "
    r"\([\d.]+ tok/s\) -> .+$"
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batch")
    paths = {
        "target": save_checkpoint(root / "target"),
        "draft": save_checkpoint(root / "draft", role="draft", seed=1),
        "long": write_video(root / "long.mp4", n=16, fps=8),
        "short": write_video(root / "short.mp4", n=8, fps=8),
        "corrupt": root / "corrupt.mp4",
    }
    paths["corrupt"].write_bytes(b"\x00garbage" * 200)
    cfg = tiny_config("target")
    cfg.text_config.max_position_embeddings = 32
    paths["target_short_context"] = root / "target_ctx"
    lookup("adapters", "qwen2_5_vl").model_class(cfg).save_pretrained(paths["target_short_context"])
    tiny_tokenizer().save_pretrained(paths["target_short_context"])
    return paths


def records(env) -> list[dict]:
    """Four questions about two videos of different lengths, some with their own settings."""
    return [
        {"id": "a", "video": str(env["long"]), "prompt": "describe the video .", "frames": 6},
        {"id": "b", "video": str(env["short"]), "prompt": "what happens ?", "max_new_tokens": 5},
        {"id": 3, "video": str(env["long"]), "prompt": "describe the video .", "frames": 2},
        {"id": "d", "video": str(env["short"]), "prompt": "is there a red square ?", "frames": 4},
    ]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def batch(env, inp: Path, out: Path, *extra: str, target: str = "target") -> list[str]:
    return ["batch", str(inp), str(out), "--target", str(env[target]), "--draft", str(env["draft"])] + [
        *FLAGS,
        "--no-progress",
        *extra,
    ]


def summary(err: str) -> tuple[int, int, int]:
    line = err.strip().splitlines()[-1]
    m = SUMMARY.match(line)
    assert m, err
    return tuple(int(g) for g in m.groups())


@pytest.fixture(scope="module")
def answered(env, tmp_path_factory) -> dict:
    """One in-process run over `records`; its OUT entries by id."""
    root = tmp_path_factory.mktemp("answered")
    out = root / "out.jsonl"
    rc = main(batch(env, write_jsonl(root / "in.jsonl", records(env)), out, "--batch-size", "2"))
    assert rc == 0
    entries = read_jsonl(out)
    assert len(entries) == 4
    return {e["id"]: e for e in entries}


def test_answers_equal_target_generate_per_record(env, answered):
    pipe = hippo.PipelineBuilder().target(str(env["target"]), dtype=torch.float64).scheduler("autoregressive")
    pipe = pipe.build()
    tokenizer = load_tokenizer(env["target"])
    for rec in records(env):
        got = answered[rec["id"]]
        inputs = load_video_inputs(
            pipe.target_adapter, rec["video"], rec["prompt"], frames=rec.get("frames"), max_pixels=3136
        )
        L = inputs["input_ids"].shape[1]
        with torch.inference_mode():
            ref = pipe.target.generate(**inputs, max_new_tokens=rec.get("max_new_tokens", 8), do_sample=False)
        assert got["token_ids"] == ref[0, L:].tolist(), rec["id"]
        assert got["prompt_tokens"] == L and got["stats"]["new_tokens"] == len(got["token_ids"])
        assert got["text"] == tokenizer.decode(got["token_ids"], skip_special_tokens=True)
        assert got["stats"]["scheduler"] == "serial" and "error" not in got
    lengths = {answered[k]["prompt_tokens"] for k in answered}
    assert len(lengths) >= 3  # the records differ in video length, so the grouping had work to do


def test_resume_after_a_kill_loses_no_row_and_repeats_none(env, answered, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", records(env))
    out = tmp_path / "out.jsonl"
    full = [json.dumps(answered[r["id"]]) for r in records(env)]
    # killed while writing the third line: two whole lines, then a third cut off mid-way
    out.write_text(full[0] + "\n" + full[1] + "\n" + full[2][: len(full[2]) // 2])
    assert main(batch(env, inp, out)) == 0
    assert summary(capsys.readouterr().err) == (2, 0, 2)
    entries = read_jsonl(out)
    ids = [e["id"] for e in entries]
    assert sorted(map(str, ids)) == ["3", "a", "b", "d"]  # none lost, none twice
    for e in entries:
        assert e["token_ids"] == answered[e["id"]]["token_ids"]
    # a finished OUT: a re-run does nothing and changes nothing
    before = out.read_bytes()
    assert main(batch(env, inp, out)) == 0
    assert summary(capsys.readouterr().err) == (0, 0, 4)
    assert out.read_bytes() == before


def _generate_error(env, capsys, video: str, *extra: str, target: str = "target") -> str:
    argv = ["generate", "--target", str(env[target]), "--draft", str(env["draft"]), "--video", video]
    assert main([*argv, "--prompt", "describe the video .", *FLAGS, "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hippo: error: ") and err.count("\n") == 1
    return err[len("hippo: error: ") :].strip()


def test_bad_records_get_the_cli_message_and_the_run_goes_on(env, tmp_path, capsys):
    missing = str(tmp_path / "missing.mp4")
    short = str(env["short"])
    rows = [
        {"id": "ok", "video": short, "prompt": "what happens ?", "frames": 2},
        {"id": "missing", "video": missing, "prompt": "what happens ?"},
        {"id": "corrupt", "video": str(env["corrupt"]), "prompt": "what happens ?"},
        {"id": "too_long", "video": str(env["long"]), "prompt": "describe the video .", "frames": 16},
        '{"id": "cut", "video": ',
        {"id": "no_video", "prompt": "what happens ?"},
        {"id": "ok", "video": short, "prompt": "again"},
        {"id": "hot", "video": short, "prompt": "p", "do_sample": True, "temperature": -1},
    ]
    inp, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    argv = batch(env, inp, out, target="target_short_context")
    assert main(argv) == 1
    assert summary(capsys.readouterr().err) == (1, 7, 0)
    entries = read_jsonl(out)
    errors = {(e["id"], e["line"]): e["error"] for e in entries if "error" in e}
    assert [e["id"] for e in entries if "error" not in e] == ["ok"]
    assert errors == {
        ("missing", 2): _generate_error(env, capsys, missing),
        ("corrupt", 3): _generate_error(env, capsys, str(env["corrupt"])),
        ("too_long", 4): _generate_error(
            env, capsys, str(env["long"]), "--frames", "16", target="target_short_context"
        ),
        (None, 5): errors[(None, 5)],
        ("no_video", 6): "record 'no_video': \"video\" must be a non-empty string, got None",
        ("ok", 7): "record 'ok': duplicate id (line 7; first on line 1); each id is answered once",
        ("hot", 8): "record 'hot': \"temperature\" must be a number > 0, got -1",
    }
    assert errors[(None, 5)].startswith("line 5 of IN is not a JSON object (")
    assert "prompt has" in errors[("too_long", 4)]  # the context check, not a video error

    # a re-run tries the failed records again and skips the answered one: one line per record still
    assert main(argv) == 1
    assert summary(capsys.readouterr().err) == (0, 7, 1)
    again = read_jsonl(out)
    assert len(again) == len(entries) and sorted(map(str, again)) == sorted(map(str, entries))


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_in", "IN '{tmp}/nope.jsonl' is not a file; pass a JSONL file with one record per line"),
        ("same_file", "IN and OUT are the same file; write the answers to another file"),
        ("bad_out", "OUT '{tmp}/out.jsonl' line 1 is not an answer hippo batch wrote"),
        ("batch_size", "--batch-size must be an integer >= 1, got 0"),
        ("window", "--window must be an integer >= --batch-size (4), got 2"),
        ("out_dir", "OUT '{tmp}' is a directory; pass a file name in it"),
    ],
)
def test_usage_errors_exit_2_before_any_work(env, tmp_path, capsys, case, message):
    inp, out = write_jsonl(tmp_path / "in.jsonl", records(env)[:1]), tmp_path / "out.jsonl"
    extra: list[str] = []
    if case == "missing_in":
        inp = tmp_path / "nope.jsonl"
    elif case == "same_file":
        out = inp
    elif case == "bad_out":
        out.write_text("not json\n" + json.dumps({"id": "x", "token_ids": []}) + "\n")
    elif case == "batch_size":
        extra = ["--batch-size", "0"]
    elif case == "window":
        extra = ["--window", "2"]
    elif case == "out_dir":
        out = tmp_path
    before = out.read_bytes() if out.is_file() else None
    assert main(batch(env, inp, out, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("hippo: error: ") and err.count("\n") == 1, err
    assert message.format(tmp=tmp_path) in err
    assert (out.read_bytes() if out.is_file() else None) == before  # OUT untouched


def test_ray_missing_is_a_usage_error_naming_the_extra(env, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    inp = write_jsonl(tmp_path / "in.jsonl", records(env)[:1])
    assert main(batch(env, inp, tmp_path / "out.jsonl", "--ray")) == 2
    err = capsys.readouterr().err
    assert err.startswith("hippo: error: --ray needs Ray Data") and "pip install 'hippo[ray]'" in err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.slow
def test_ray_answers_equal_the_in_process_ones(env, answered, tmp_path, capsys, monkeypatch):
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    monkeypatch.chdir(env["long"].parent)  # relative video paths: from the driver's directory
    rows = [{**r, "video": Path(r["video"]).name} for r in records(env)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    # a killed earlier run left one answer: the Ray run must resume from it too
    write_jsonl(out, [answered["a"]])
    ray.init("local", num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        # a local instance never grows: asking for a GPU it lacks fails at once, not after a wait forever
        assert main(batch(env, inp, out, "--ray", "--ray-num-gpus", "1")) == 2
        err = capsys.readouterr().err
        assert (
            "the local Ray instance has 1 CPUs and 0 GPUs, too few for 1 actor(s) of --ray-num-cpus 1" in err
        )
        assert read_jsonl(out) == [answered["a"]]  # OUT untouched
        rc = main(batch(env, inp, out, "--ray", "--ray-actors", "1", "--window", "2", "--batch-size", "2"))
    finally:
        ray.shutdown()
    assert rc == 0
    assert summary(capsys.readouterr().err) == (3, 0, 1)
    entries = read_jsonl(out)
    assert sorted(map(str, (e["id"] for e in entries))) == ["3", "a", "b", "d"]
    for e in entries:
        want = answered[e["id"]]
        assert (e["token_ids"], e["text"], e["prompt_tokens"]) == (
            want["token_ids"],
            want["text"],
            want["prompt_tokens"],
        )


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["batch", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for opt in (
        "IN.jsonl OUT.jsonl --target --draft --config --backbone --device --dtype --scheduler --scorer "
        "--selector --keep-ratio --gamma --frames --fps --max-pixels --max-new-tokens --do-sample "
        "--temperature --top-p --top-k --seed --batch-size --window --no-progress --ray --ray-num-cpus "
        "--ray-num-gpus --ray-actors --debug"
    ).split():
        assert opt in out, opt
    assert "--video" not in out and "--prompt" not in out  # they come from the records
    text = " ".join(out.split())
    assert "today" not in text
    assert "a finished row's place taken by the next" in text and "continuously batched" in text


def test_the_default_scheduler_decodes_batches_together(env, answered, tmp_path):
    """Without --scheduler (the default, `auto`) the records of a batch are decoded together too, and
    each answer is the serial run's (the target's own `generate`: test_answers_equal_target_generate_per_record)."""
    flags = [f for f in FLAGS if f not in ("--scheduler", "serial", "--gamma", "3")]
    out = tmp_path / "out.jsonl"
    args = [
        "batch",
        str(write_jsonl(tmp_path / "in.jsonl", records(env))),
        str(out),
        "--target",
        str(env["target"]),
    ]
    args += ["--draft", str(env["draft"]), *flags, "--no-progress", "--batch-size", "2"]
    assert main(args) == 0
    got = {e["id"]: e for e in read_jsonl(out)}
    assert set(got) == set(answered)
    for rid, entry in got.items():
        assert entry["token_ids"] == answered[rid]["token_ids"], rid
        stats = entry["stats"]
        assert stats["scheduler"] == "auto" and stats["plan"]["batch"] == 2, stats
        assert any("batch of 2" in n for n in stats["notes"]), stats["notes"]
