"""decord input: a real short video written by the test, plus every bad-file case."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hippo.errors import ConfigError, VideoError
from hippo.video import read_audio, read_video, sample_indices

av = pytest.importorskip("av")


def write_video(path, n=16, fps=8, size=(48, 64), audio=False):
    h, w = size
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        a = c.add_stream("aac", rate=16000) if audio else None
        for i in range(n):
            f = np.zeros((h, w, 3), np.uint8)
            f[:, (i * 3) % w : (i * 3) % w + 8] = 255
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
        if a is not None:
            t = np.arange(int(16000 * n / fps)) / 16000
            tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None]
            for start in range(0, tone.shape[1], 1024):
                frame = av.AudioFrame.from_ndarray(
                    tone[:, start : start + 1024], format="fltp", layout="mono"
                )
                frame.sample_rate = 16000
                for p in a.encode(frame):
                    c.mux(p)
            for p in a.encode():
                c.mux(p)
    return path


def test_reads_sampled_frames(tmp_path):
    clip = read_video(write_video(tmp_path / "v.mp4"), frames=4)
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
    assert sample_indices(10, 5.0, frames=20) == list(range(10))
    with pytest.raises(ConfigError):
        sample_indices(10, 5.0, frames=2, sample_fps=1.0)
    with pytest.raises(ConfigError):
        sample_indices(10, 5.0, frames=0)
