"""`hippo generate` and `hippo bias` end to end on tiny checkpoints saved with `save_pretrained`.

Two runs go through the installed console script in a subprocess (the full run with --compare-ar and
--json, and one error); the rest call `hippo.cli.main.main([...])` in-process, which is the same code
without the ~2-5 s start-up. Every bad input must give exit status 2 and one line on stderr, and the
Python API must raise the typed exception with the same message.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import hippo
from hippo.cli.main import main
from hippo.errors import ConfigError, InputError, ModelError, VideoError
from hippo.media.inputs import check_tokenizers, decode_video, load_tokenizer, load_video_inputs
from hippo.registry import lookup

pytest.importorskip("av")
from tiny_checkpoint import save_checkpoint, tiny_tokenizer, write_video  # noqa: E402

PROMPT = "describe the video ."
SUMMARY = re.compile(
    r"^\[(\w+)\] (\d+) new tokens \| MAT \d+\.\d\d \| [\d.]+ tok/s \| TTFT [\d.]+s \| pruning [\d.]+ ms \| total [\d.]+s$"
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("generate")
    f64 = {"dtype": torch.float64}  # the pair whose answers are compared with target.generate exactly
    paths = {
        "target": save_checkpoint(root / "target", **f64),
        "draft": save_checkpoint(root / "draft", role="draft", seed=1, **f64),
        "draft_other_tokenizer": save_checkpoint(root / "draft_tok", role="draft", seed=1, shift=1),
        "target_no_tokenizer": save_checkpoint(root / "target_no_tok", tokenizer=False),
        "video": write_video(root / "v.mp4", n=16, fps=8, size=(64, 64)),
        "corrupt": root / "corrupt.mp4",
        "no_weights": root / "no_weights",
        "empty_dir": root / "empty",
    }
    paths["corrupt"].write_bytes(b"\x00garbage" * 200)
    paths["gpu_map"] = root / "gpu_map.json"
    paths["gpu_map"].write_text(json.dumps({"model": "cpu", "lm_head": "cuda:1"}))
    paths["zero_frames"] = write_video(root / "zero.mp4", n=0)
    paths["empty_dir"].mkdir()
    paths["no_weights"].mkdir()
    shutil.copy(paths["target"] / "config.json", paths["no_weights"] / "config.json")

    from hippo.adapters.qwen2_5_vl_tiny import tiny_config

    Qwen = lookup("adapters", "qwen2_5_vl").model_class
    cfg = tiny_config("draft")
    cfg.text_config.vocab_size = 170
    paths["draft_big_vocab"] = root / "draft_vocab"
    Qwen(cfg).save_pretrained(paths["draft_big_vocab"])
    tiny_tokenizer().save_pretrained(paths["draft_big_vocab"])
    cfg = tiny_config("target")
    cfg.text_config.max_position_embeddings = 32
    paths["target_short_context"] = root / "target_ctx"
    Qwen(cfg).save_pretrained(paths["target_short_context"])
    tiny_tokenizer().save_pretrained(paths["target_short_context"])
    for name, cut in (("truncated_weights", "half"), ("corrupt_weights", "garbage")):
        paths[name] = root / name
        shutil.copytree(paths["target"], paths[name])
        w = paths[name] / "model.safetensors"
        data = w.read_bytes()
        w.write_bytes(data[: len(data) // 2] if cut == "half" else b"\x00garbage" * 200)
    paths["draft_other_family"] = save_checkpoint(root / "draft_q3", "qwen3_vl", "draft", seed=1)
    # an audio-visual backbone, when its adapter is installed and ships a tiny model (a failure to save
    # one that it ships is an error, not a skip)
    from hippo.testing.models import tiny_adapters

    if "video_salmonn2_plus" in tiny_adapters():
        paths["av_target"] = save_checkpoint(root / "av_target", "video_salmonn2_plus")
        paths["av_draft"] = save_checkpoint(root / "av_draft", "video_salmonn2_plus", "draft", seed=1)
    return {k: str(v) for k, v in paths.items()}


def argv(env: dict[str, str], *extra: str, **replace: str) -> list[str]:
    """`hippo generate` on the tiny pair; `replace` swaps a flag's value (target="...", video=...)."""
    opts = {
        "target": env["target"],
        "draft": env["draft"],
        "video": env["video"],
        "prompt": PROMPT,
        "frames": "4",
        "max-pixels": "3136",
        "max-new-tokens": "10",
        "scheduler": "hippo",
        "gamma": "3",
        "keep-ratio": "0.25",
    }
    for key, value in replace.items():
        key = key.replace("_", "-")
        if value is None:
            opts.pop(key)
        else:
            opts[key] = value
    out = ["generate"]
    for key, value in opts.items():
        out += [f"--{key}", value]
    return [*out, "--no-progress", *extra]


def one_line_error(err: str) -> str:
    assert err.startswith("hippo: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err[len("hippo: error: ") :].strip()


def console(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    exe = shutil.which("hippo")
    cmd = [exe] if exe else [sys.executable, "-m", "hippo.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the tiny models gain nothing from threads
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env)


# ---- the console script ----------------------------------------------------------------------------


def test_console_generate_end_to_end(env, tmp_path) -> None:
    out_json = tmp_path / "out.json"
    proc = console(*argv(env, "--compare-ar", "--json", str(out_json)))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out_json.read_text())
    # stdout is exactly the streamed answer; stderr ends with the summary and the comparison
    assert proc.stdout == result["text"] + "\n" and result["text"].strip()
    lines = proc.stderr.strip().splitlines()
    hippo_line, ar_line, compare = lines[-3:]
    assert SUMMARY.match(hippo_line).groups() == ("hippo", "10")
    assert SUMMARY.match(ar_line).groups() == ("autoregressive", "10")
    assert re.match(
        r"^speedup over autoregressive \(both warm\): [\d.]+x \| outputs identical: yes$", compare
    )
    assert "Traceback" not in proc.stderr

    assert len(result["tokens"]) == 10 and result["compare_ar"]["identical"] is True
    assert result["compare_ar"]["tokens"] == result["tokens"] and result["compare_ar"]["speedup"] > 0
    stats = result["stats"]
    assert stats["new_tokens"] == 10 and stats["scheduler"] == "hippo" and stats["mat"] >= 1
    assert stats["visual_tokens"] == 8 and stats["kept_visual_tokens"] == 2
    for key in (
        "seconds_ttft",
        "seconds_pruning",
        "tokens_per_second",
        "acceptance_rate",
        "accepted_per_round",
    ):
        assert key in stats
    s = result["settings"]
    assert s["backbone"] == "qwen2_5_vl" and s["scorer"] == {"name": "holistic", "options": {}}
    assert s["selector"] == {"name": "topk", "options": {"keep_ratio": 0.25}}
    assert s["scheduler"] == {"name": "hippo", "options": {"gamma": 3}}
    assert result["video"]["frames"] == 4 and result["video"]["indices"] == [2, 6, 10, 14]

    # the answer is the target's own: transformers' generate on the same inputs
    pipe = hippo.PipelineBuilder().target(env["target"]).scheduler("autoregressive").build()
    inputs = load_video_inputs(pipe.target_adapter, env["video"], PROMPT, frames=4, max_pixels=3136)
    assert inputs["input_ids"].shape[1] == result["prompt_tokens"]
    with torch.inference_mode():
        ref = pipe.target.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert ref[0, result["prompt_tokens"] :].tolist() == result["tokens"]


def test_console_error_contract(env) -> None:
    """A corrupt file: ffmpeg's own log lines (file descriptor 2) must not reach the user either."""
    proc = console(*argv(env, video=env["corrupt"]))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "cannot decode" in one_line_error(proc.stderr)


# ---- in-process runs -------------------------------------------------------------------------------


def test_streams_the_answer_then_the_summary(env, capsys) -> None:
    assert main(argv(env, "--scheduler", "serial")) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and len(out.split()) >= 1
    assert SUMMARY.match(err.strip().splitlines()[-1]).groups() == ("serial", "10")


def test_streamer_and_stage_bars() -> None:
    from hippo.cli.video_commands import StageBars, text_streamer

    buf = io.StringIO()
    bars = StageBars(disable=False, file=buf)
    bars("video decode", "update", done=2, total=4)
    bars("video decode", "update", done=4, total=4)
    bars("vision encoding", "start")
    bars("vision encoding", "end")
    assert (
        "video decode" in buf.getvalue() and "4/4" in buf.getvalue() and "vision encoding" in buf.getvalue()
    )
    assert not bars.bars  # every bar closed
    streamer = text_streamer(tiny_tokenizer())
    quiet = StageBars(disable=False, file=io.StringIO(), streamer=streamer)
    streamer.started = True  # once the answer streams, no more bars
    quiet("draft prefill", "start")
    assert quiet.file.getvalue() == ""


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_config_file_and_flags_override_it(env, tmp_path, capsys, suffix) -> None:
    cfg = tmp_path / f"pipe{suffix}"
    if suffix == ".json":
        cfg.write_text(
            json.dumps(
                {
                    "target": env["target"],
                    "draft": env["draft"],
                    "scheduler": {"name": "serial", "gamma": 2},
                    "selector": {"name": "uniform", "keep_ratio": 0.5},
                }
            )
        )
    else:
        cfg.write_text(
            f'target = "{env["target"]}"\ndraft = "{env["draft"]}"\n'
            '[scheduler]\nname = "serial"\ngamma = 2\n[selector]\nname = "uniform"\nkeep_ratio = 0.5\n'
        )
    out_json = tmp_path / "out.json"
    args = argv(
        env, "--config", str(cfg), "--json", str(out_json), target=None, draft=None, scheduler=None, gamma="4"
    )
    args.remove("--keep-ratio")
    args.remove("0.25")
    assert main(args) == 0, capsys.readouterr().err
    s = json.loads(out_json.read_text())
    assert s["settings"]["scheduler"] == {"name": "serial", "options": {"gamma": 4}}  # the flag wins
    assert s["settings"]["selector"] == {"name": "uniform", "options": {"keep_ratio": 0.5}}  # the file's
    assert s["settings"]["scorer"] is None and s["stats"]["scheduler"] == "serial"
    # a new selector name keeps the file's keep ratio
    assert main([*args, "--selector", "topk", "--scorer", "holistic"]) == 0
    s = json.loads(out_json.read_text())["settings"]
    assert s["selector"] == {"name": "topk", "options": {"keep_ratio": 0.5}}


def test_target_device_map_and_draft_device(env, tmp_path, capsys, monkeypatch) -> None:
    """--target-device-map FILE reaches the target's from_pretrained, --draft-device places the draft,
    and the answer is the target's own (--compare-ar: identical, exit 0); the config file takes both."""
    adapter = lookup("adapters", "qwen2_5_vl")
    loads: list[dict] = []
    original = adapter.load.__func__

    def load(cls, path, **kwargs):
        loads.append({"path": str(path), **kwargs})
        return original(cls, path, **kwargs)

    monkeypatch.setattr(adapter, "load", classmethod(load))
    layout = {"model.visual": "cpu", "model.language_model": "cpu", "lm_head": "cpu"}
    dmap = tmp_path / "map.json"
    dmap.write_text(json.dumps(layout))
    out_json = tmp_path / "out.json"
    extra = (
        "--target-device-map",
        str(dmap),
        "--draft-device",
        "cpu",
        "--compare-ar",
        "--json",
        str(out_json),
    )
    assert main(argv(env, *extra)) == 0, capsys.readouterr().err
    assert "outputs identical: yes" in capsys.readouterr().err
    assert [d.get("device_map") for d in loads if d["path"] == env["target"]] == [layout]
    assert all("device_map" not in d for d in loads if d["path"] == env["draft"])
    s = json.loads(out_json.read_text())["settings"]
    assert s["target_device_map"] == str(dmap) and s["draft_device"] == "cpu"
    cfg = tmp_path / "pipe.toml"
    cfg.write_text(f'target_device_map = "{dmap}"\ndraft_device = "cpu"\n')
    loads.clear()
    assert main(argv(env, "--config", str(cfg))) == 0
    assert loads[0]["device_map"] == layout


def test_sampling_is_reproducible_and_compared_fairly(env, tmp_path, capsys) -> None:
    runs = []
    for i in range(2):
        path = tmp_path / f"s{i}.json"
        sample = ["--do-sample", "--temperature", "0.9", "--top-p", "0.95", "--seed", "7"]
        assert main(argv(env, *sample, "--compare-ar", "--json", str(path))) == 0
        runs.append(json.loads(path.read_text()))
    assert runs[0]["tokens"] == runs[1]["tokens"]
    assert runs[0]["settings"]["generation"] == {
        "max_new_tokens": 10,
        "do_sample": True,
        "temperature": 0.9,
        "top_p": 0.95,
    }
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "outputs identical: yes" in last or "expected when sampling" in last


def test_system_is_the_chat_templates_system_turn(env, tmp_path) -> None:
    """--system: the answer is target.generate's on the chat template's rendering of the system turn,
    then the video and the prompt (another prompt than without it)."""
    from hippo.conversation import Prompt
    from hippo.media.inputs import load_video_inputs

    path = tmp_path / "s.json"
    assert main(argv(env, "--system", "this is a bright red square .", "--json", str(path))) == 0
    got = json.loads(path.read_text())
    assert got["settings"]["system"] == "this is a bright red square ."
    pipe = (
        hippo.PipelineBuilder().target(env["target"], dtype=torch.float64).scheduler("autoregressive").build()
    )
    system = Prompt(PROMPT, "this is a bright red square .")
    inputs = load_video_inputs(pipe.target_adapter, env["video"], system, frames=4, max_pixels=3136)
    plain = load_video_inputs(pipe.target_adapter, env["video"], PROMPT, frames=4, max_pixels=3136)
    text = pipe_tokenizer(env).decode(inputs["input_ids"][0])
    assert "<|im_start|> system this is a bright red square . <|im_end|> <|im_start|> user" in text
    assert inputs["input_ids"].shape[1] > plain["input_ids"].shape[1]
    L = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        ref = pipe.target.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert got["tokens"] == ref[0, L:].tolist()


def pipe_tokenizer(env):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(env["target"])


# ---- bad input ---------------------------------------------------------------------------------------

CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")

BAD = {
    "missing video": (dict(video="{video}.missing"), (), "does not exist; check the path"),
    "video is a directory": (dict(video="{empty_dir}"), (), "is not a file; pass a video file"),
    "corrupt video": (dict(video="{corrupt}"), (), "cannot decode"),
    "zero-frame video": (dict(video="{zero_frames}"), (), "as a video (corrupt, truncated, or not a video"),
    "tokenizers differ": (dict(draft="{draft_other_tokenizer}"), (), "the draft's tokenizer"),
    "vocabularies differ": (
        dict(draft="{draft_big_vocab}"),
        (),
        "draft vocabulary (170) differs from the target's (160)",
    ),
    "unknown backbone": ({}, ("--backbone", "nope"), "unknown adapter 'nope'; registered adapters:"),
    "unknown scorer": ({}, ("--scorer", "nope"), "unknown scorer 'nope'; registered scorers:"),
    "unknown scheduler": ({}, ("--scheduler", "nope"), "unknown scheduler 'nope'"),
    "keep ratio 0": (dict(keep_ratio="0"), (), "keep_ratio must be a number in (0, 1], got 0.0"),
    "keep ratio > 1": (dict(keep_ratio="1.5"), (), "keep_ratio must be a number in (0, 1], got 1.5"),
    "gamma 0": (dict(gamma="0"), (), "gamma must be an integer >= 1, got 0"),
    "gamma with auto": (dict(scheduler="auto"), (), "--gamma does not apply to scheduler 'auto'"),
    "frames 0": (dict(frames="0"), (), "--frames must be >= 1"),
    "max pixels 0": (dict(max_pixels="0"), (), "--max-pixels must be >= 1"),
    "too many frames": (
        dict(target="{target_short_context}", draft=None, frames="16", gamma=None),
        ("--scheduler", "autoregressive"),
        "but the target's context is 32; use fewer frames (--frames / frames=) or a lower resolution",
    ),
    "no weights": (dict(target="{no_weights}"), (), "has no weights (*.safetensors or *.bin)"),
    "no config": (dict(draft="{empty_dir}"), (), "has no config.json; save it with save_pretrained()"),
    "not a directory": (dict(target="{video}"), (), "is not a directory"),
    "no tokenizer": (dict(target="{target_no_tokenizer}"), (), "has no tokenizer"),
    "no draft": (dict(draft=None), (), "scheduler 'hippo' needs a draft model: pass --draft PATH"),
    "temperature without sampling": (
        {},
        ("--temperature", "0.5"),
        "--temperature only applies when sampling",
    ),
    "bad top-p": ({}, ("--do-sample", "--top-p", "1.5"), "--top-p must be in (0, 1]"),
    "json directory missing": ({}, ("--json", "/nonexistent-dir/x.json"), "its directory does not exist"),
    "truncated weights": (
        dict(target="{truncated_weights}"),
        (),
        "model.safetensors' is truncated or corrupt: its header declares",
    ),
    "corrupt weights": (
        dict(draft="{corrupt_weights}"),
        (),
        "is truncated or corrupt (no valid header); re-download the checkpoint or restore model.safetensors",
    ),
    "draft of another family": (
        dict(draft="{draft_other_family}"),
        (),
        "the draft is a qwen3_vl model but the target is a qwen2_5_vl model",
    ),
    "frames beyond the video": (
        dict(frames="40"),
        (),
        "40 frames were asked for but video '{video}' has only 16; pass --frames / frames= of at most 16",
    ),
    "fps not a number": (dict(frames=None), ("--fps", "nan"), "--fps must be a finite number > 0, got nan"),
    "fps infinite": (dict(frames=None), ("--fps", "inf"), "--fps must be a finite number > 0, got inf"),
    "temperature not a number": (
        {},
        ("--do-sample", "--temperature", "nan"),
        "--temperature must be a finite number > 0, got nan",
    ),
    "seed too large": ({}, ("--seed", str(2**64)), "--seed must be in [0, 2**63)"),
    "backbone contradicts the checkpoint": (
        {},
        ("--backbone", "qwen3_vl"),
        "is a qwen2_5_vl model (model_type 'qwen2_5_vl'), not qwen3_vl; drop --backbone",
    ),
    "unknown device": ({}, ("--device", "foo"), "device 'foo' is not a device name; use cpu, cuda or cuda:N"),
    "unknown device map": (
        {},
        ("--target-device-map", "balance"),
        "target_device_map 'balance' is neither a device map name (auto, balanced, balanced_low_0, "
        "sequential) nor a JSON file",
    ),
    "device map not JSON": ({}, ("--target-device-map", "{corrupt}"), "is not valid JSON"),
    "device map unreadable": ({}, ("--target-device-map", "/nonexistent/map.json"), "cannot be read"),
    "device and device map": (
        {},
        ("--device", "cpu", "--target-device-map", "auto"),
        "both place the target (--device, --target-device-map)",
    ),
    "unknown draft device": ({}, ("--draft-device", "gpu"), "draft device 'gpu' is not a device name"),
    "json is a directory": ({}, ("--json", "/tmp"), "--json '/tmp' is a directory; pass a file name in it"),
    "cuda without cuda": pytest.param(
        {}, ("--device", "cuda"), "CUDA is not available; use --device cpu", marks=CUDA
    ),
    "draft on cuda without cuda": pytest.param(
        {}, ("--draft-device", "cuda:3"), "CUDA is not available; use --draft-device cpu", marks=CUDA
    ),
    "device map entry on cuda without cuda": pytest.param(
        {}, ("--target-device-map", "{gpu_map}"), "device map entry 'lm_head': device 'cuda:1'", marks=CUDA
    ),
}


def _fill(env: dict[str, str], replace: dict, extra: tuple) -> list[str]:
    replace = {k: (None if v is None else v.format(**env)) for k, v in replace.items()}
    return argv(env, *(e.format(**env) for e in extra), **replace)


@pytest.mark.parametrize("replace, extra, message", BAD.values(), ids=BAD.keys())
def test_bad_input_is_one_line_and_exit_2(env, capsys, replace, extra, message) -> None:
    assert main(_fill(env, replace, extra)) == 2
    out, err = capsys.readouterr()
    assert message.format(**env) in one_line_error(err)
    assert out == ""


def test_unknown_plugin_option_in_the_config_file(env, tmp_path, capsys) -> None:
    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"selector": {"name": "topk", "keep_ratio": 0.1, "bogus": 1}}))
    assert main(argv(env, "--config", str(cfg), keep_ratio=None)) == 2
    assert "unknown option(s) bogus; valid options: keep_ratio" in one_line_error(capsys.readouterr().err)


def test_audio_requested_but_absent(env, capsys) -> None:
    if "av_target" not in env:
        pytest.skip("no audio-visual adapter with a tiny model")
    assert main(argv(env, target=env["av_target"], draft=env["av_draft"])) == 2
    assert "has no readable audio track, but this backbone needs audio" in one_line_error(
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--fps", "1"), "argument --fps: not allowed with argument --frames"),
        (("--gama", "3"), "unrecognized arguments: --gama 3"),
        (("--dtype", "int8"), "argument --dtype: invalid choice: 'int8'"),
    ],
)
def test_usage_errors_are_one_line(env, capsys, extra, message) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv(env, *extra))
    assert info.value.code == 2
    assert message in one_line_error(capsys.readouterr().err)


def test_debug_shows_the_traceback(env, capsys) -> None:
    assert main(["--debug", *argv(env, video=env["video"] + ".missing")]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "VideoError" in err
    assert err.strip().splitlines()[-1].startswith("hippo: error: video file")


def _api_errors(env: dict[str, str]):
    """(CLI argv, a Python API call that meets the same condition, the exception type it raises)."""
    B = hippo.PipelineBuilder
    short = env["target_short_context"]

    def too_long():
        pipe = B().target(short).scheduler("autoregressive").build()
        load_video_inputs(pipe.target_adapter, env["video"], PROMPT, frames=16, max_pixels=3136)

    return [
        (argv(env, video=env["corrupt"]), lambda: decode_video(env["corrupt"], frames=4), VideoError),
        (argv(env, keep_ratio="0"), lambda: B().selector("topk", keep_ratio=0.0), ConfigError),
        (argv(env, gamma="0"), lambda: B().scheduler("hippo", gamma=0), ConfigError),
        (
            argv(env, "--scheduler", "autoregressive", target=short, draft=None, frames="16", gamma=None),
            too_long,
            InputError,
        ),
        (
            argv(env, draft=env["draft_other_tokenizer"]),
            lambda: check_tokenizers(
                load_tokenizer(env["target"]),
                load_tokenizer(env["draft_other_tokenizer"]),
                env["target"],
                env["draft_other_tokenizer"],
            ),
            ModelError,
        ),
        (argv(env, target=env["no_weights"]), lambda: B().target(env["no_weights"]).build(), ModelError),
        (
            argv(env, target=env["truncated_weights"]),
            lambda: B().target(env["truncated_weights"]).build(),
            ModelError,
        ),
        (argv(env, frames="40"), lambda: decode_video(env["video"], frames=40), InputError),
        (
            argv(env, draft=env["draft_other_family"]),
            lambda: B().target(env["target"]).draft(env["draft_other_family"]).build(),
            ModelError,
        ),
        (
            argv(env, draft=env["draft_big_vocab"]),
            lambda: B().target(env["target"]).draft(env["draft_big_vocab"]).build(),
            ModelError,
        ),
    ]


def test_python_api_raises_the_same_typed_errors(env, capsys) -> None:
    for cli_argv, call, exc_type in _api_errors(env):
        capsys.readouterr()
        assert main(cli_argv) == 2
        cli_message = one_line_error(capsys.readouterr().err)
        with pytest.raises(exc_type) as info:
            call()
        assert " ".join(str(info.value).split()) == cli_message


# ---- hippo bias ------------------------------------------------------------------------------------


def test_bias_writes_png_and_json(env, tmp_path, capsys) -> None:
    png, js = tmp_path / "bias.png", tmp_path / "bias.json"
    args = ["bias", "--target", env["target"], "--video", env["video"], "--prompt", PROMPT]
    args += [
        "--frames",
        "4",
        "--max-pixels",
        "12544",
        "--keep-ratio",
        "0.25",
        "--png",
        str(png),
        "--json",
        str(js),
    ]
    assert main([*args, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(js.read_text())
    assert set(result["methods"]) == {"attention", "holistic"} and result["keep_ratio"] == 0.25
    assert result["frames"] == 2 and result["tokens"] == 32 and result["video"]["frames"] == 4
    assert "position bias: top 25% of 32 visual tokens kept" in out
    assert re.search(r"^attention +8 ", out, re.M) and re.search(r"^holistic +8 ", out, re.M)
    assert (
        main(
            [
                "bias",
                "--target",
                env["target"],
                "--video",
                env["video"],
                "--prompt",
                PROMPT,
                "--keep-ratio",
                "2",
            ]
        )
        == 2
    )
    assert "keep_ratio must be a number in (0, 1]" in one_line_error(capsys.readouterr().err)


# ---- help ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command, options",
    [
        (
            "generate",
            "--target --draft --video --prompt --backbone --scheduler --scorer --selector --keep-ratio --gamma "
            "--frames --fps --max-pixels --max-new-tokens --do-sample --temperature --top-p --top-k --seed "
            "--device --dtype --system --compare-ar --json --config --no-progress --debug --target-device-map "
            "--draft-device",
        ),
        ("chat", "--target-device-map --draft-device --device"),
        ("batch", "--target-device-map --draft-device --device"),
        ("serve", "--target-device-map --draft-device --device"),
        (
            "bias",
            "--target --video --prompt --keep-ratio --boundary --png --json --frames --fps --max-pixels "
            "--backbone --device --dtype --no-progress --debug",
        ),
    ],
)
def test_help_lists_every_option(capsys, command: str, options: str) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for opt in options.split():
        assert opt in out, opt
    with pytest.raises(SystemExit):
        main(["--help"])
    assert command in capsys.readouterr().out
