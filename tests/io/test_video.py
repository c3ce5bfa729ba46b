"""decord input: a real short video written by the test, plus every bad-file case."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoint import write_video

from hippo.errors import ConfigError, InputError, VideoError
from hippo.media.video import read_audio, read_video, sample_indices

pytest.importorskip("av")


def test_reads_sampled_frames(tmp_path):
    clip = read_video(write_video(tmp_path / "v.mp4", size=(48, 64)), frames=4)
    assert clip.frames.shape == (4, 48, 64, 3) and clip.frames.dtype == torch.uint8
    assert clip.indices == (2, 6, 10, 14)
    assert torch.allclose(clip.timestamps, torch.tensor([2, 6, 10, 14], dtype=torch.float64) / 8)
    # the bright bar moves right over time: the content is really decoded
    cols = [int(f.float().mean(dim=(0, 2)).argmax()) for f in clip.frames]
    assert cols == sorted(cols) and cols[0] < cols[-1]


def test_fps_sampling(tmp_path):
    clip = read_video(write_video(tmp_path / "v.mp4"), fps=1.0)  # 2 s of video at 1 fps
    assert len(clip.indices) == 2


def test_audio_track(tmp_path):
    samples = read_audio(write_video(tmp_path / "a.mp4", audio=True))
    assert samples.dim() == 1 and samples.numel() > 16000 and samples.abs().max() > 0.1


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: p / "missing.mp4", "does not exist"),
        (lambda p: p, "not a file"),
        (lambda p: (p / "bad.mp4").write_bytes(b"garbage" * 100) and p / "bad.mp4", "cannot decode"),
    ],
)
def test_bad_video_files(tmp_path, make, match):
    with pytest.raises(VideoError, match=match):
        read_video(make(tmp_path))


def test_audio_absent(tmp_path):
    with pytest.raises(VideoError, match="no readable audio"):
        read_audio(write_video(tmp_path / "silent.mp4"))


def test_sampling_options():
    assert sample_indices(10, 5.0, frames=10) == list(range(10))
    assert sample_indices(10, 5.0, sample_fps=100.0) == list(range(10))  # a rate takes at most all frames
    with pytest.raises(InputError, match="20 frames were asked for but the video has only 10"):
        sample_indices(10, 5.0, frames=20)
    with pytest.raises(ConfigError):
        sample_indices(10, 5.0, frames=2, sample_fps=1.0)
    with pytest.raises(ConfigError):
        sample_indices(10, 5.0, frames=0)
