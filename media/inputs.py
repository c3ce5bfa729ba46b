"""Backbone inputs from a video file and a prompt: checkpoint checks, decoding, chat template, pixels.

    inputs = load_video_inputs(pipe.target_adapter, "clip.mp4", "What happens?", frames=16)
    out = pipe.generate(inputs, max_new_tokens=128)

`load_video_inputs` = `decode_video` (decord, sampled frames) + `build_video_inputs` (the adapter's
`build_inputs`: the tokenizer's chat template with a video item, the video placeholder expanded to
the right number of tokens, and the pixel values). The helpers below are what the adapters share.
Every failure is a typed `hippo.errors` exception whose message names the problem and the fix; the
CLI prints the same messages.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from hippo.builder import check_device  # noqa: F401 - re-exported for the CLI
from hippo.checkpoint import check_backbone_fits, check_checkpoint  # noqa: F401 - re-exported
from hippo.conversation import system_message
from hippo.errors import ConfigError, HippoError, InputError, ModelError, VideoError
from hippo.media.video import open_sampled
from hippo.sampling import check_vocab
from hippo.types import VideoClip

#: progress(stage, event): event is "start", "end", or "update" (with done/total for video decode).
Progress = Callable[..., None]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
PROCESSOR_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")
DECODE_CHUNK = 16  # frames decoded per decord call (one progress step)


@attrs.frozen
class SampledVideo(VideoClip):
    """A `VideoClip` that also knows how many frames the file has (for the sampled frame rate)."""

    total_frames: int = 0

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sampled clip, as transformers' `VideoMetadata.sampled_fps`."""
        return sampled_fps(self)


# ---- checkpoints ----------------------------------------------------------------------------------


def load_config(path: str | os.PathLike) -> Any:
    """The checkpoint's transformers config (plugins loaded first, so their config classes are known)."""
    from transformers import AutoConfig

    from hippo.registry import plugin_manager

    plugin_manager()
    try:
        return AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(
            f"cannot read the config.json of checkpoint {str(path)!r} ({exc}); re-save it with "
            "save_pretrained() or install the hippo adapter plugin for its model type"
        ) from exc


def detect_backbone(config: Any, backbone: str = "auto") -> type:
    """The adapter class: `backbone` by name, or the one whose hook claims the config ("auto")."""
    from hippo.registry import lookup, resolve_adapter

    if backbone in (None, "auto"):
        return resolve_adapter(config)
    cls = lookup("adapters", backbone)
    check_backbone_fits(cls, config, getattr(config, "_name_or_path", "") or "the checkpoint")
    return cls


def needs_audio(adapter_cls: type, config: Any = None) -> bool:
    return (
        bool(getattr(adapter_cls, "needs_audio", False)) or getattr(config, "audio_config", None) is not None
    )


def text_vocab_size(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return None if size is None else int(size)


def check_vocab_sizes(target_config: Any, draft_config: Any) -> None:
    """Draft and target must score the same vocabulary (checked from their configs, before loading)."""
    p, q = text_vocab_size(target_config), text_vocab_size(draft_config)
    if p is not None and q is not None:
        check_vocab(p, q)  # the builder's rule and message


def has_tokenizer(path: str | os.PathLike) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The checkpoint's tokenizer (AutoTokenizer, no downloads)."""
    from transformers import AutoTokenizer

    if not has_tokenizer(path):
        raise ModelError(
            f"checkpoint {str(path)!r} has no tokenizer (tokenizer.json or tokenizer_config.json); "
            "save the model's tokenizer next to it with tokenizer.save_pretrained(), or pass tokenizer="
        )
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load the tokenizer of checkpoint {str(path)!r}: {exc}") from exc


def check_tokenizers(
    target_tokenizer: Any, draft_tokenizer: Any, target: str = "target", draft: str = "draft"
) -> None:
    """The draft must tokenize exactly as the target: same token -> id map."""
    p, q = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if p == q:
        return
    differ = sum(1 for t in set(p) | set(q) if p.get(t) != q.get(t))
    raise ModelError(
        f"the draft's tokenizer ({draft}) differs from the target's ({target}): {differ} of "
        f"{max(len(p), len(q))} tokens map to different ids; speculative decoding needs one tokenizer: "
        "use a draft of the same model family"
    )


def model_dir(model: torch.nn.Module) -> str | None:
    """The local directory a model was loaded from, if any."""
    path = getattr(model, "name_or_path", None) or getattr(
        getattr(model, "config", None), "_name_or_path", None
    )
    return str(path) if path and Path(path).is_dir() else None


def load_video_processor(path: str | os.PathLike | None) -> Any:
    """The checkpoint's transformers video processor, or None where it cannot be used.

    transformers' video processors need torchvision; without it (or without a processor config in the
    checkpoint) the adapters lay the pixels out themselves, the way those processors do.
    """
    if path is None or importlib.util.find_spec("torchvision") is None:
        return None
    if not any((Path(path) / f).is_file() for f in PROCESSOR_FILES):
        return None
    from transformers import AutoVideoProcessor

    try:
        return AutoVideoProcessor.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, ImportError):
        return None


def processor_settings(path: str | os.PathLike | None) -> dict[str, Any]:
    """Normalisation and resolution settings from the checkpoint's processor config, if it has one."""
    import json

    if path is None:
        return {}
    for name in PROCESSOR_FILES:
        f = Path(path) / name
        if f.is_file():
            try:
                data = json.loads(f.read_text())
            except ValueError:
                return {}
            out = {k: data[k] for k in ("image_mean", "image_std") if k in data}
            size = data.get("size") or {}
            if isinstance(size, dict):
                if "shortest_edge" in size and "longest_edge" in size:
                    out["min_pixels"], out["max_pixels"] = size["shortest_edge"], size["longest_edge"]
            for k in ("min_pixels", "max_pixels"):
                if k in data:
                    out[k] = data[k]
            return out
    return {}


# ---- video ----------------------------------------------------------------------------------------


def decode_video(
    path: str | os.PathLike,
    *,
    frames: int | None = None,
    fps: float | None = None,
    progress: Progress | None = None,
) -> SampledVideo:
    """Decode the sampled frames (`frames` evenly spaced, or `fps` per second; default 2 fps) as uint8 RGB.

    `progress("video decode", "update", done=, total=)` is called after each chunk of frames.
    """
    with native_stderr_silenced():  # ffmpeg/decord log to fd 2; the VideoError says what went wrong
        vr, idx, rate = open_sampled(path, frames, fps)
    chunks = []
    for start in range(0, len(idx), DECODE_CHUNK):
        part = idx[start : start + DECODE_CHUNK]
        try:
            with native_stderr_silenced():
                chunks.append(torch.from_numpy(vr.get_batch(part).asnumpy()))
        except Exception as exc:  # decord raises bare DECORDErrors
            raise VideoError(
                f"decoding frames of {str(path)!r} failed; the file may be truncated: re-encode it, e.g. "
                f"`ffmpeg -i in -c:v libx264 out.mp4` ({str(exc).splitlines()[0][:120] if str(exc) else exc!r})"
            ) from None
        if progress is not None:
            progress("video decode", "update", done=start + len(part), total=len(idx))
    stamps = torch.tensor(idx, dtype=torch.float64) / (rate if rate > 0 else 1.0)
    return SampledVideo(
        frames=torch.cat(chunks), timestamps=stamps, fps=rate, indices=tuple(idx), total_frames=len(vr)
    )


def read_audio_track(path: str | os.PathLike) -> torch.Tensor:  # -> [S] float32 mono, 16 kHz
    from hippo.media.video import read_audio

    with native_stderr_silenced():
        return read_audio(path)


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null meanwhile: native libraries' log lines, not Python's."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (captured, redirected in-process)
        fd = 2
    sys.stderr.flush()
    try:
        saved = os.dup(fd)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)


def sampled_fps(clip: VideoClip) -> float:
    """Frame rate of the sampled frames: T / total · fps (transformers' VideoMetadata.sampled_fps)."""
    fps = clip.fps if clip.fps and clip.fps > 0 else 24.0
    total = getattr(clip, "total_frames", 0)
    T = len(clip.indices)
    if total:
        return T / total * fps
    span = clip.indices[-1] - clip.indices[0] if T > 1 else 0
    return fps * (T - 1) / span if span > 0 else fps


def smart_resize(
    height: int,
    width: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    frames: int = 1,
    temporal: int = 1,
) -> tuple[int, int]:
    """Sides that are multiples of `factor`, pixels in [min_pixels, max_pixels], aspect ratio kept.

    As transformers' Qwen2-VL `smart_resize` (frames=1), or Qwen3-VL's (the pixel budget covers all
    `frames`, rounded to the temporal patch), except that a `max_pixels` below `min_pixels` wins.
    """
    if frames > 1 and (height < factor or width < factor):  # Qwen3-VL first scales tiny frames up
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / max(1, min(height, width)) > 200:
        raise InputError(
            f"the video's aspect ratio {width}x{height} is more extreme than 200:1; crop it first"
        )
    min_pixels = min(min_pixels, max_pixels)
    t = max(temporal, round(frames / temporal) * temporal) if frames > 1 else 1
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def resize_frames_uint8(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """frames [T, H, W, 3] uint8 -> [T, height, width, 3] uint8 (bicubic, antialiased), as transformers'
    processors resize uint8 frames on a CPU: torchvision's resize runs torch's native uint8 kernel
    for bicubic there (resizing in float32 and rounding back gives pixels a few levels apart, about
    15x slower). The frames themselves when the size is already right.
    """
    if tuple(frames.shape[1:3]) == (height, width):
        return frames
    x = torch.nn.functional.interpolate(
        frames.permute(0, 3, 1, 2), size=(height, width), mode="bicubic", antialias=True, align_corners=False
    )  # [T, 3, height, width] uint8
    return x.permute(0, 2, 3, 1)


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """frames [T, H, W, 3] uint8 -> [T, height, width, 3] floats in [0, 1] (`resize_frames_uint8` / 255)."""
    return resize_frames_uint8(frames, height, width).float() / 255.0


# ---- text -----------------------------------------------------------------------------------------


def chat_text(tokenizer: Any, prompt: str) -> str:
    """One user turn (a video item, then the prompt) through the tokenizer's chat template, after the
    system turn of a `hippo.conversation.Prompt` (`hippo generate --system`, a served system message)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError("the prompt is empty; pass the question or instruction about the video")
    user = {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": str(prompt)}]}
    messages = [*system_message(getattr(prompt, "system", None)), user]
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(
            "the tokenizer has no chat template; use the checkpoint's own tokenizer files "
            "(tokenizer_config.json or chat_template.jinja with the template)"
        )
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja errors
        raise ModelError(f"the tokenizer's chat template failed on a video + text turn: {exc}") from exc


def token_string(tokenizer: Any, token_id: int, what: str = "video") -> str:
    tok = tokenizer.convert_ids_to_tokens(int(token_id)) if int(token_id) < len(tokenizer) else None
    if not tok:
        raise ModelError(
            f"the tokenizer has no token for the model's {what} token id {token_id}; use the tokenizer "
            "saved with this checkpoint"
        )
    return tok


def expand_placeholder(
    text: str, placeholder: str, replacement: str, wrapped: tuple[str, str] | None = None
) -> str:
    """Replace the one video placeholder (with its `wrapped` start/end tokens, when present) by `replacement`."""
    count = text.count(placeholder)
    if count != 1:
        raise ModelError(
            f"the chat template rendered {count} video placeholders ({placeholder!r}) for one video; "
            "use the checkpoint's own tokenizer and chat template"
        )
    if wrapped is not None:
        full = f"{wrapped[0]}{placeholder}{wrapped[1]}"
        if full in text:
            return text.replace(full, replacement, 1)
    return text.replace(placeholder, replacement, 1)


def tokenize(tokenizer: Any, text: str, token_id: int, expected: int) -> torch.Tensor:  # -> [1, L]
    """Token ids of the rendered prompt; checks that it holds exactly `expected` video tokens."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    got = int((ids == token_id).sum())
    if got != expected:
        raise ModelError(
            f"the prompt tokenizes to {got} video tokens but the video needs {expected}; the tokenizer "
            "does not treat the video placeholder as a special token: use the checkpoint's own tokenizer"
        )
    return ids


# ---- the whole thing ------------------------------------------------------------------------------


def build_video_inputs(
    adapter: Any,
    tokenizer: Any,
    clip: VideoClip,
    prompt: str,
    *,
    max_pixels: int | None = None,
    video_processor: Any = "auto",
    audio: torch.Tensor | None = None,
) -> dict[str, Any]:
    """`adapter.build_inputs(...)` plus the context check. `video_processor="auto"`: the checkpoint's, if usable."""
    if max_pixels is not None and max_pixels < 1:
        raise ConfigError(f"max_pixels must be >= 1, got {max_pixels}")
    auto = isinstance(video_processor, str) and video_processor == "auto"
    if auto:
        video_processor = load_video_processor(model_dir(adapter.model))

    def build(processor: Any) -> dict[str, Any]:
        return adapter.build_inputs(
            tokenizer, clip, prompt, max_pixels=max_pixels, video_processor=processor, audio=audio
        )

    try:
        inputs = build(video_processor)
    except HippoError:
        raise
    except Exception as exc:  # noqa: BLE001 - the checkpoint's processor failed: lay the pixels out ourselves
        if not (auto and video_processor is not None):
            raise
        warnings.warn(
            f"the checkpoint's video processor failed ({exc!r}); building the pixel values without it",
            RuntimeWarning,
            stacklevel=2,
        )
        inputs = build(None)
    L, ctx = int(inputs["input_ids"].shape[-1]), adapter.context_length()
    if L >= ctx:
        frames = len(clip.indices)
        raise InputError(
            f"the prompt has {L} tokens ({frames} frames of video) but the target's context is {ctx}; "
            "use fewer frames (--frames / frames=) or a lower resolution (--max-pixels / max_pixels=)"
        )
    return inputs


def load_video_inputs(
    adapter: Any,
    path: str | os.PathLike,
    prompt: str,
    *,
    tokenizer: Any = None,
    frames: int | None = None,
    fps: float | None = None,
    max_pixels: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Processor-shaped inputs for `adapter` (the target's) from a video file and a prompt.

    `tokenizer` defaults to the one saved in the directory the target model was loaded from.
    """
    if tokenizer is None:
        where = model_dir(adapter.model)
        if where is None:
            raise ConfigError(
                "the target was not loaded from a local checkpoint directory, so its tokenizer is unknown; "
                "pass tokenizer=AutoTokenizer.from_pretrained(...)"
            )
        tokenizer = load_tokenizer(where)
    clip = decode_video(path, frames=frames, fps=fps, progress=progress)
    audio = read_audio_track(path) if needs_audio(type(adapter), adapter.model.config) else None
    return build_video_inputs(adapter, tokenizer, clip, prompt, max_pixels=max_pixels, audio=audio)
