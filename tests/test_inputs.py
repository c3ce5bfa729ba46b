"""hippo.media.inputs and the adapters' `build_inputs`: a video file + a prompt -> processor-shaped inputs.

Tiny random checkpoints and the tiny word-level tokenizer come from tests/tiny_checkpoint.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hippo
from hippo.errors import ConfigError, InputError, ModelError, UnsupportedError, VideoError
from hippo.media.inputs import (
    SampledVideo,
    build_video_inputs,
    check_checkpoint,
    check_tokenizers,
    decode_video,
    load_video_inputs,
    smart_resize,
)
from hippo.registry import lookup

pytest.importorskip("av")
from tiny_checkpoint import save_checkpoint, tiny_tokenizer, write_video  # noqa: E402

PROMPT = "describe the video ."
VIDEO_ID, START, END = 153, 150, 151
# frames and pixel caps that keep every tiny model at a few visual tokens per frame
SMALL = {"qwen2_5_vl": 56 * 56, "qwen3_vl": 64 * 64, "llava_onevision": None}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    out = {"video": write_video(root / "v.mp4", n=16, fps=8, size=(64, 64))}
    for adapter in SMALL:
        # float64: the lossless test compares tokens with target.generate exactly
        for role, seed in (("target", 0), ("draft", 1)):
            path = root / adapter / role
            out[f"{adapter}/{role}"] = save_checkpoint(path, adapter, role, seed=seed, dtype=torch.float64)
    return out


def clip_of(frames: torch.Tensor, fps: float = 8.0, step: int = 4) -> SampledVideo:
    T = frames.shape[0]
    idx = tuple(range(0, T * step, step))
    stamps = torch.tensor(idx, dtype=torch.float64) / fps
    return SampledVideo(frames=frames, timestamps=stamps, fps=fps, indices=idx, total_frames=T * step)


# ---- resizing ----------------------------------------------------------------------------------------


def test_smart_resize_matches_the_qwen_processors() -> None:
    assert smart_resize(64, 64, 28, 128 * 28 * 28, 768 * 28 * 28) == (336, 336)  # scaled up to min_pixels
    assert smart_resize(480, 640, 28, 3136, 200_000) == (364, 504)  # scaled down under max_pixels
    assert smart_resize(64, 64, 28, 128 * 28 * 28, 56 * 56) == (56, 56)  # a max below the min wins
    # Qwen3-VL: the budget covers all frames
    assert smart_resize(64, 64, 32, 128 * 32 * 32, 768 * 32 * 32, frames=16, temporal=2) == (96, 96)
    with pytest.raises(InputError, match="aspect ratio"):
        smart_resize(4, 4000, 28, 1, 10**9)


# ---- decoding -----------------------------------------------------------------------------------------


def test_decode_video_reports_progress(files) -> None:
    calls = []
    clip = decode_video(files["video"], frames=4, progress=lambda *a, **k: calls.append((a, k)))
    assert clip.frames.shape == (4, 64, 64, 3) and clip.frames.dtype == torch.uint8
    assert clip.indices == (2, 6, 10, 14) and clip.total_frames == 16 and clip.fps == 8.0
    assert clip.sampled_fps == pytest.approx(2.0)
    assert calls == [(("video decode", "update"), {"done": 4, "total": 4})]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: p / "missing.mp4", "does not exist"),
        (lambda p: p, "not a file"),
        (lambda p: (p / "bad.mp4").write_bytes(b"garbage" * 100) and p / "bad.mp4", "cannot decode"),
    ],
)
def test_decode_bad_files(tmp_path, make, match) -> None:
    with pytest.raises(VideoError, match=match):
        decode_video(make(tmp_path))


# ---- build_inputs ---------------------------------------------------------------------------------------


def test_qwen2_5_vl_inputs_are_the_processor_layout(files) -> None:
    pipe = hippo.PipelineBuilder().target(str(files["qwen2_5_vl/target"])).scheduler("autoregressive").build()
    frames = (torch.rand(4, 56, 56, 3) * 255).round().to(torch.uint8)
    tok = tiny_tokenizer()
    inputs = pipe.target_adapter.build_inputs(tok, clip_of(frames), PROMPT, max_pixels=56 * 56)
    ref = lookup("adapters", "qwen2_5_vl").synthetic_inputs(pipe.target, frames.float() / 255, [1], [2])
    # no resize at 56x56: the same pixels (to rounding: two normalisations of the same uint8 frames)
    torch.testing.assert_close(inputs["pixel_values_videos"], ref["pixel_values_videos"], check_dtype=False)
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 4]]
    ids = inputs["input_ids"][0].tolist()
    n = ids.count(VIDEO_ID)
    assert n == 2 * 4 * 4 // 4
    start = ids.index(START)
    assert ids[start + 1 : start + 1 + n] == [VIDEO_ID] * n and ids[start + 1 + n] == END
    assert tok.decode(ids[start + n + 2 :]) == "describe the video . <|im_end|> <|im_start|> assistant"
    assert torch.equal(inputs["mm_token_type_ids"], (inputs["input_ids"] == VIDEO_ID).long() * 2)
    # temporal patch 2 / sampled fps (4 frames out of 16 at 8 fps: 2 fps)
    assert inputs["second_per_grid_ts"].tolist() == [pytest.approx(1.0)]


@pytest.mark.parametrize("shape", [(4, 56, 84), (3, 28, 28), (6, 112, 56)])
def test_uint8_frames_are_laid_out_as_their_floats_are(shape) -> None:
    """The media path lays uint8 frames out as bytes and normalises them afterwards: bit for bit the
    pixel values of the same frames as floats in [0, 1] (what the benchmarks' pairs were trained on)."""
    from hippo.adapters.qwen2_5_vl import frames_to_pixel_values

    frames = torch.randint(0, 256, (*shape, 3), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    fast, grid = frames_to_pixel_values(frames)
    ref, ref_grid = frames_to_pixel_values(frames.float() / 255.0)
    assert torch.equal(fast, ref) and torch.equal(grid, ref_grid)


def test_frames_are_resized_by_torchs_uint8_kernel() -> None:
    """Bicubic and antialiased in uint8, as torchvision's resize runs it on a CPU (and the processors
    with it); a clip already at the size is passed through."""
    from hippo.media.inputs import resize_frames_uint8

    frames = torch.randint(0, 256, (3, 100, 150, 3), generator=torch.Generator().manual_seed(1)).to(
        torch.uint8
    )
    out = resize_frames_uint8(frames, 56, 84)
    ref = torch.nn.functional.interpolate(
        frames.permute(0, 3, 1, 2), size=(56, 84), mode="bicubic", antialias=True, align_corners=False
    )
    assert out.dtype == torch.uint8 and torch.equal(out, ref.permute(0, 2, 3, 1))
    assert resize_frames_uint8(frames, 100, 150) is frames


def test_qwen2_5_vl_resizes_to_max_pixels(files) -> None:
    pipe = hippo.PipelineBuilder().target(str(files["qwen2_5_vl/target"])).scheduler("autoregressive").build()
    frames = torch.zeros(3, 100, 150, 3, dtype=torch.uint8)
    inputs = pipe.target_adapter.build_inputs(tiny_tokenizer(), clip_of(frames), PROMPT, max_pixels=84 * 112)
    t, h, w = inputs["video_grid_thw"][0].tolist()
    assert t == 2  # 3 frames, the last repeated to fill the temporal patch
    assert (h * 14) * (w * 14) <= 84 * 112 and (h * 14) % 28 == 0 and (w * 14) % 28 == 0


def test_qwen3_vl_inputs_have_timestamps(files) -> None:
    pipe = hippo.PipelineBuilder().target(str(files["qwen3_vl/target"])).scheduler("autoregressive").build()
    frames = torch.zeros(4, 64, 64, 3, dtype=torch.uint8)
    tok = tiny_tokenizer()
    inputs = pipe.target_adapter.build_inputs(tok, clip_of(frames), PROMPT, max_pixels=64 * 64)
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert "second_per_grid_ts" not in inputs
    text = tok.decode(inputs["input_ids"][0])
    # frames 0, 4 | 8, 12 at 8 fps: patches at (0 + 0.5) / 2 and (1 + 1.5) / 2 seconds
    frame = "<|vision_start|> " + "<|video_pad|> " * 4 + "<|vision_end|>"
    assert f"< 0 . 2 seconds > {frame} < 1 . 2 seconds > {frame} describe" in text
    assert text.count("<|vision_start|>") == 2  # the template's own start/end tokens were replaced


def test_llava_onevision_inputs(files) -> None:
    pipe = (
        hippo.PipelineBuilder()
        .target(str(files["llava_onevision/target"]))
        .scheduler("autoregressive")
        .build()
    )
    frames = torch.full((3, 40, 60, 3), 255, dtype=torch.uint8)
    inputs = pipe.target_adapter.build_inputs(tiny_tokenizer(), clip_of(frames), PROMPT)
    assert inputs["pixel_values_videos"].shape == (1, 3, 3, 112, 112)
    assert inputs["input_ids"][0].tolist().count(VIDEO_ID) == 3 * 4 * 4 + 1  # + the newline token
    mean, std = (
        torch.tensor([0.48145466, 0.4578275, 0.40821073]),
        torch.tensor([0.26862954, 0.26130258, 0.27577711]),
    )
    torch.testing.assert_close(
        inputs["pixel_values_videos"][0, 0, :, 0, 0], (1 - mean) / std, check_dtype=False
    )


@pytest.mark.parametrize("adapter", sorted(SMALL))
def test_generate_from_video_is_lossless(files, adapter: str) -> None:
    p, q = str(files[f"{adapter}/target"]), str(files[f"{adapter}/draft"])
    pipe = (
        hippo.PipelineBuilder()
        .target(p)
        .draft(q)
        .scorer("holistic")
        .selector("topk", keep_ratio=0.25)
        .scheduler("serial", gamma=3)
        .build()
    )
    stages = []
    out = pipe.generate_from_video(
        files["video"],
        PROMPT,
        frames=4,
        max_pixels=SMALL[adapter],
        max_new_tokens=10,
        progress=lambda stage, event, **kw: stages.append((stage, event)),
    )
    inputs = load_video_inputs(
        pipe.target_adapter, files["video"], PROMPT, frames=4, max_pixels=SMALL[adapter]
    )
    with torch.inference_mode():
        ref = pipe.target.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert torch.equal(out.sequences, ref)
    assert ("video decode", "update") in stages
    for stage in ("vision encoding", "target prefill", "draft prefill"):
        assert stages.index((stage, "start")) < stages.index((stage, "end"))


# ---- errors -------------------------------------------------------------------------------------------


def test_the_base_adapter_cannot_build_inputs() -> None:
    class Bare(hippo.Adapter):
        name = "bare"
        vocab_size = context_length = encode = prefill = None

    with pytest.raises(UnsupportedError, match="cannot build its inputs from a video file"):
        Bare(torch.nn.Linear(1, 1)).build_inputs(None, None, PROMPT)


def test_prompt_longer_than_the_context(files, tmp_path) -> None:
    from hippo.adapters.qwen2_5_vl_tiny import tiny_config

    cfg = tiny_config("target")
    cfg.text_config.max_position_embeddings = 32
    model = lookup("adapters", "qwen2_5_vl").model_class(cfg).eval()
    pipe = hippo.PipelineBuilder().target(model).scheduler("autoregressive").build()
    with pytest.raises(InputError, match=r"context is 32; use fewer frames \(--frames / frames=\)"):
        load_video_inputs(pipe.target_adapter, files["video"], PROMPT, tokenizer=tiny_tokenizer(), frames=16)


def test_tokenizer_errors(files) -> None:
    pipe = hippo.PipelineBuilder().target(str(files["qwen2_5_vl/target"])).scheduler("autoregressive").build()
    clip = clip_of(torch.zeros(2, 56, 56, 3, dtype=torch.uint8))
    no_template = tiny_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ModelError, match="no chat template"):
        build_video_inputs(pipe.target_adapter, no_template, clip, PROMPT)
    text_only = tiny_tokenizer()
    text_only.chat_template = "{{ bos_token }}{{ messages[0]['content'][1]['text'] }}"
    with pytest.raises(ModelError, match="rendered 0 video placeholders"):
        build_video_inputs(pipe.target_adapter, text_only, clip, PROMPT)
    with pytest.raises(InputError, match="prompt is empty"):
        build_video_inputs(pipe.target_adapter, tiny_tokenizer(), clip, "  ")
    with pytest.raises(ModelError, match="differs from the target's"):
        check_tokenizers(tiny_tokenizer(), tiny_tokenizer(shift=1))
    check_tokenizers(tiny_tokenizer(), tiny_tokenizer())


def test_tokenizer_of_an_in_memory_model_must_be_passed(files) -> None:
    model = lookup("adapters", "qwen2_5_vl").tiny_model("target")
    pipe = hippo.PipelineBuilder().target(model).scheduler("autoregressive").build()
    with pytest.raises(ConfigError, match="pass tokenizer="):
        pipe.generate_from_video(files["video"], PROMPT)
    out = pipe.generate_from_video(
        files["video"], PROMPT, tokenizer=tiny_tokenizer(), frames=2, max_new_tokens=3
    )
    assert out.stats.new_tokens == 3


def test_checkpoint_checks(tmp_path) -> None:
    with pytest.raises(ModelError, match="is not a directory"):
        check_checkpoint(tmp_path / "nope")
    with pytest.raises(ModelError, match="has no config.json"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="has no weights"):
        check_checkpoint(tmp_path)
