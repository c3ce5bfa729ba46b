"""video-SALMONN 2+ inputs from a real video file with its audio track (`build_inputs`).

A short mp4 with an AAC tone is written with PyAV and decoded with hippo's readers; the tiny
video-SALMONN 2+ checkpoints are saved next to a word-level tokenizer in which the tiny vocabulary's
audio id (154) is the special token `<|audio_pad|>`, as the released tokenizer adds it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import WhisperFeatureExtractor

import hippo
from hippo.adapters.video_salmonn2_plus import VideoSalmonn2PlusAdapter
from hippo.adapters.video_salmonn2_plus_tiny import AUDIO, synthetic_inputs, tiny_model
from hippo.errors import InputError, ModelError, VideoError
from hippo.media.inputs import decode_video, load_video_inputs, read_audio_track

pytest.importorskip("av")
from tiny_checkpoint import tiny_tokenizer, write_video  # noqa: E402

F64 = torch.float64
PROMPT = "describe the video ."
START, END, VIDEO = 150, 151, 153
# 24 frames at 8 fps = 3 s; 8 sampled frames: 8/3 fps, so s = 2 / (8/3) = 0.75 s per temporal grid step
N, FPS, FRAMES, SECONDS = 24, 8, 8, 3.0
SIZE = 56  # 56 x 56 frames: 4 x 4 patches, 2 x 2 merged tokens per grid step, no resizing
MAX_PIXELS = SIZE * SIZE


def av_tokenizer():
    """tiny_checkpoint's tokenizer with id 154 as the special token `<|audio_pad|>`."""
    return tiny_tokenizer(extra_special={"<|audio_pad|>": AUDIO})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("salmonn_video")
    out = {
        "av": write_video(root / "av.mp4", n=N, fps=FPS, size=(SIZE, SIZE), audio=True),
        "silent": write_video(root / "silent.mp4", n=N, fps=FPS, size=(SIZE, SIZE)),
    }
    for role, seed in (("target", 0), ("draft", 1)):
        tiny_model(role, seed=seed, dtype=F64).save_pretrained(root / role)
        av_tokenizer().save_pretrained(root / role)
        out[role] = root / role
    return out


@pytest.fixture(scope="module")
def target():
    return tiny_model("target", dtype=F64)


def whisper_features(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Log-mel features of the tiny config's 2 s chunks, straight from transformers."""
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=2)
    return fe([p.numpy() for p in pieces], sampling_rate=16000, return_tensors="pt").input_features


def test_build_inputs_from_a_video_file_with_audio(files, target):
    clip = decode_video(files["av"], frames=FRAMES)
    wave = read_audio_track(files["av"])  # [S] float32, 16 kHz
    assert clip.sampled_fps == pytest.approx(8 / 3) and abs(wave.numel() - 48000) < 16000
    adapter = VideoSalmonn2PlusAdapter(target)
    tok = av_tokenizer()
    inputs = adapter.build_inputs(tok, clip, PROMPT, max_pixels=MAX_PIXELS, audio=wave)
    assert inputs["video_grid_thw"].tolist() == [[4, 4, 4]]  # 8 frames -> 4 grid steps of 2 x 2 tokens
    assert inputs["second_per_grid_ts"].tolist() == [pytest.approx(0.75)]
    ids = inputs["input_ids"][0].tolist()
    # 3 s of audio -> 2 chunks of 2 s -> 8 tokens; step j gets f(j+1) - f(j) with f(j) = floor(2 · 0.75 · j)
    # = 0, 1, 3, 4: 1, 2, 1, and the last step the remainder (8 - 4)
    v, a = VIDEO, AUDIO
    block = [START, *[v] * 4, a, *[v] * 4, a, a, *[v] * 4, a, *[v] * 4, a, a, a, a, END]
    s = ids.index(START)
    assert ids[s : s + len(block)] == block and ids.count(v) == 16 and ids.count(a) == 8
    assert tok.decode(ids[s + len(block) :]) == "describe the video . <|im_end|> <|im_start|> assistant"
    assert torch.equal(inputs["mm_token_type_ids"][0], torch.tensor([{v: 2, a: 3}.get(i, 0) for i in ids]))
    assert inputs["audio_lengths"].tolist() == [8]
    # the track, cut to the clip's 3 s, through Whisper's feature extractor in 2 s pieces
    cut = wave[:48000]
    assert torch.equal(inputs["audio_feature"], whisper_features([cut[:32000], cut[32000:]]).to(F64))
    # and exactly what the tiny module lays out for the same frames and waveform
    ref = synthetic_inputs(
        target,
        clip.frames.float() / 255,
        ids[:s],
        ids[s + len(block) :],
        audio=cut,
        second_per_grid=float(inputs["second_per_grid_ts"][0]),
    )
    assert inputs.keys() == ref.keys()
    for key, value in ref.items():
        assert torch.equal(inputs[key], value), key


def test_audio_is_padded_or_trimmed_to_the_clip(files, target):
    clip = decode_video(files["av"], frames=FRAMES)
    wave = read_audio_track(files["av"])[:48000]
    adapter = VideoSalmonn2PlusAdapter(target)
    tok = av_tokenizer()

    def build(audio):
        return adapter.build_inputs(tok, clip, PROMPT, max_pixels=MAX_PIXELS, audio=audio)

    full = build(wave)
    longer = build(torch.cat([wave, torch.ones(40000)]))  # 2.5 s more than the video: cut off
    assert all(torch.equal(full[k], longer[k]) for k in full)
    short = build(wave[:16000])  # 1 s of a 3 s clip: zero-padded, still 2 chunks, 8 tokens
    padded = torch.cat([wave[:16000], torch.zeros(32000)])
    assert short["audio_lengths"].tolist() == [8] and torch.equal(short["input_ids"], full["input_ids"])
    assert torch.equal(short["audio_feature"], whisper_features([padded[:32000], padded[32000:]]).to(F64))
    with pytest.raises(InputError, match="mono waveform"):
        build(torch.stack([wave, wave]))
    with pytest.raises(InputError, match="waveform is empty"):
        build(torch.zeros(0))


@pytest.mark.parametrize("positions", ["released", "training"])
def test_generate_from_video_is_lossless(files, positions, tmp_path):
    target = files["target"]
    if positions != "released":  # the layout option travels in config.json
        target = tmp_path / "target"
        m = tiny_model("target", dtype=F64, positions=positions)
        m.save_pretrained(target)
        av_tokenizer().save_pretrained(target)
    pipe = (
        hippo.PipelineBuilder()
        .target(str(target), dtype=F64)
        .draft(str(files["draft"]), dtype=F64)
        .selector("uniform", keep_ratio=0.25)
        .scheduler("serial", gamma=3)
        .build()
    )
    assert pipe.target_adapter.positions == positions
    out = pipe.generate_from_video(
        files["av"], PROMPT, frames=FRAMES, max_pixels=MAX_PIXELS, max_new_tokens=12
    )
    inputs = load_video_inputs(pipe.target_adapter, files["av"], PROMPT, frames=FRAMES, max_pixels=MAX_PIXELS)
    assert int((inputs["input_ids"] == AUDIO).sum()) == 8
    with torch.inference_mode():
        ref = pipe.target.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, ref)
    assert out.kept_visual_index is not None and len(out.kept_visual_index) == 4  # 16 video tokens pruned


def test_video_without_audio_track(files, target):
    pipe = hippo.PipelineBuilder().target(str(files["target"]), dtype=F64).scheduler("autoregressive").build()
    with pytest.raises(VideoError, match="has no readable audio track, but this backbone needs audio"):
        load_video_inputs(pipe.target_adapter, files["silent"], PROMPT, frames=FRAMES)
    with pytest.raises(InputError, match="has no readable audio track"):
        pipe.generate_from_video(files["silent"], PROMPT, frames=FRAMES, max_new_tokens=2)
    clip = decode_video(files["silent"], frames=FRAMES)
    with pytest.raises(InputError, match="needs the video's audio track, but no audio was given"):
        VideoSalmonn2PlusAdapter(target).build_inputs(av_tokenizer(), clip, PROMPT, audio=None)


def test_tokenizer_without_an_audio_token(files, target):
    clip = decode_video(files["av"], frames=FRAMES)
    with pytest.raises(ModelError, match="does not treat 'w94' .id 154. as one token"):
        VideoSalmonn2PlusAdapter(target).build_inputs(
            tiny_tokenizer(), clip, PROMPT, max_pixels=MAX_PIXELS, audio=torch.zeros(48000)
        )
