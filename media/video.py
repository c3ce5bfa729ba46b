"""Reading videos (and their audio) with decord, with errors a user can act on."""

from __future__ import annotations

import math
import os
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from hippo.errors import ConfigError, InputError, VideoError
from hippo.types import VideoClip


def _open(path: str | os.PathLike):
    import decord

    p = Path(path)
    if not p.exists():
        raise VideoError(f"video file {str(p)!r} does not exist; check the path")
    if not p.is_file():
        raise VideoError(f"{str(p)!r} is not a file; pass a video file such as an .mp4")
    try:
        return decord.VideoReader(str(p), ctx=decord.cpu(0))
    except Exception as exc:  # decord raises bare RuntimeErrors/DECORDErrors
        raise VideoError(
            f"cannot decode {str(p)!r} as a video (corrupt, truncated, or not a video container); "
            f"re-encode it, e.g. `ffmpeg -i in -c:v libx264 out.mp4` ({str(exc).splitlines()[0][:120]})"
        ) from None


def sample_indices(
    n_frames: int,
    fps: float,
    frames: int | None = None,
    sample_fps: float | None = None,
    source: str = "the video",
) -> list[int]:
    """Frame numbers to decode: `frames` evenly spaced, or one every 1/`sample_fps` seconds (default 2 fps).

    Asking for more frames than the file has is an error; the default rate takes at most all of them.
    """
    if frames is not None and sample_fps is not None:
        raise ConfigError("choose frames by count or by fps, not both")
    if frames is not None and frames < 1:
        raise ConfigError(f"frames must be >= 1, got {frames}")
    if sample_fps is not None and not 0 < sample_fps < math.inf:
        raise ConfigError(f"fps must be a finite number > 0, got {sample_fps}")
    if frames is not None and frames > n_frames:
        raise InputError(
            f"{frames} frames were asked for but {source} has only {n_frames}; pass --frames / frames= "
            f"of at most {n_frames}"
        )
    if frames is None:
        duration = n_frames / fps if fps > 0 else n_frames
        frames = max(1, math.floor(duration * (sample_fps or 2.0)))
    frames = min(frames, n_frames)
    return sorted({min(n_frames - 1, int((i + 0.5) * n_frames / frames)) for i in range(frames)})


def open_sampled(
    path: str | os.PathLike, frames: int | None, fps: float | None
) -> tuple[Any, list[int], float]:
    """Open a video file and choose the frames to decode: (decord reader, frame numbers, file fps)."""
    vr = _open(path)
    if len(vr) == 0:
        raise VideoError(f"video {str(path)!r} has zero frames; nothing to describe")
    rate = float(vr.get_avg_fps() or 0.0)
    return vr, sample_indices(len(vr), rate, frames, fps, source=f"video {str(path)!r}"), rate


def read_video(path: str | os.PathLike, *, frames: int | None = None, fps: float | None = None) -> VideoClip:
    """Decode sampled frames of a video file as uint8 RGB."""
    vr, idx, rate = open_sampled(path, frames, fps)
    try:
        batch = torch.from_numpy(vr.get_batch(idx).asnumpy())
    except Exception as exc:
        raise VideoError(
            f"decoding frames of {str(path)!r} failed; the file may be truncated ({exc})"
        ) from None
    stamps = torch.tensor(idx, dtype=torch.float64) / (rate if rate > 0 else 1.0)
    return VideoClip(frames=batch, timestamps=stamps, fps=rate, indices=tuple(idx))


def read_audio(path: str | os.PathLike, *, sample_rate: int = 16000) -> torch.Tensor:  # -> [S] float32 mono
    """The file's audio track, resampled to mono at `sample_rate` Hz (Whisper uses 16 kHz)."""
    import decord

    p = Path(path)
    if not p.is_file():
        raise VideoError(f"media file {str(p)!r} does not exist; check the path")
    try:
        ar = decord.AudioReader(str(p), ctx=decord.cpu(0), sample_rate=sample_rate, mono=True)
    except Exception:
        raise VideoError(
            f"{str(p)!r} has no readable audio track, but this backbone needs audio; pass a video with "
            "sound (video-SALMONN 2+ reads the audio track as part of its prompt)"
        ) from None
    samples = torch.from_numpy(ar[:].asnumpy()).float().reshape(-1)
    if samples.numel() == 0:
        raise VideoError(f"the audio track of {str(p)!r} is empty")
    return samples


def write_video(path: str | os.PathLike, frames: torch.Tensor, fps: float) -> Path:  # frames: [T, H, W, 3]
    """Write frames (floats in [0, 1] or uint8) losslessly: FFV1 in Matroska, which decord reads back bit-exact.

    `path` should end in .mkv. Uses PyAV (a hippo dependency); no ffmpeg binary is needed.
    """
    import av

    if frames.dim() != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise InputError(f"frames must be [T, H, W, 3] with T >= 1, got {tuple(frames.shape)}")
    if not 0 < fps < math.inf:
        raise ConfigError(f"fps must be a finite number > 0, got {fps}")
    if frames.dtype != torch.uint8:
        frames = (frames.float().clamp(0, 1) * 255).round().to(torch.uint8)
    T, H, W, _ = frames.shape
    p = Path(path)
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(p), "w") as container:
        stream = container.add_stream("ffv1", rate=rate)
        stream.width, stream.height, stream.pix_fmt = W, H, "bgr0"
        for f in frames.numpy():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())
    return p
