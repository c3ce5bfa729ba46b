"""video-SALMONN 2+ processor-shaped inputs for one audio-visual clip.

Shared by the adapter's `build_inputs` (a decoded video file and its soundtrack) and the tiny module's
`synthetic_inputs` (random frames), so both lay out the same thing:

- `audio_feature` [n_chunks, mel, 100·chunk] and `audio_lengths` [1]: Whisper log-mel features of the
  16 kHz mono waveform (`audio_inputs`: under 1 s padded to 1 s, cut into `chunk_length` pieces);
- the clip's token block: `<|vision_start|>`, per temporal grid step its h·w/merge² video tokens then
  its share n_j of the audio tokens (2 per second: one query per 0.5 s window), `<|vision_end|>`
  (`clip_ids`; the last step takes the remainder, chunk padding included);
- `mm_token_type_ids`: 2 on video tokens, `AUDIO_TYPE` (3) on audio tokens, 0 elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch

from hippo.adapters.video_salmonn2_plus_model import AUDIO_TYPE, SAMPLE_RATE, audio_inputs
from hippo.adapters.video_salmonn2_plus_positions import clip_ids
from hippo.errors import InputError


def audio_tokens_per_second(audio_config: Any) -> float:
    """Queries per window over seconds per window stride: 2 for the released config."""
    return audio_config.qformer_config.query_length / audio_config.second_stride


def fit_audio(waveform: torch.Tensor, seconds: float) -> torch.Tensor:  # -> [round(seconds · 16 kHz)]
    """A mono 16 kHz waveform [S] made exactly `seconds` long: zero-padded at the end, or trimmed."""
    wav = torch.as_tensor(waveform).detach().to("cpu", torch.float32)
    if wav.dim() == 2 and 1 in wav.shape:
        wav = wav.reshape(-1)
    if wav.dim() != 1:
        raise InputError(
            f"the audio must be a mono waveform [samples] at {SAMPLE_RATE} Hz, got shape {tuple(wav.shape)}; "
            "read it with hippo.media.inputs.read_audio_track(path)"
        )
    if wav.numel() == 0:
        raise InputError("the audio waveform is empty; this backbone needs the video's audio track")
    n = max(1, round(seconds * SAMPLE_RATE))
    return torch.nn.functional.pad(wav, (0, n - wav.numel())) if wav.numel() < n else wav[:n]


def clip_inputs(
    model: Any,
    pixel_values_videos: torch.Tensor,  # [N_patch, D]
    video_grid_thw: torch.Tensor,  # [1, 3] in patches
    second_per_grid: float,
    audio: torch.Tensor | None,  # [S] mono 16 kHz, or None: video only (stock Qwen2.5-VL layout)
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The clip's token block (vision start ... vision end) and its tensors, audio features included."""
    cfg = model.config
    merge = int(cfg.vision_config.spatial_merge_size)
    steps = int(video_grid_thw[0, 0])
    per_step = int(video_grid_thw[0, 1] * video_grid_thw[0, 2]) // merge**2
    extra: dict[str, torch.Tensor] = {}
    n_audio = 0
    if audio is not None:
        extra = audio_inputs(audio, cfg.audio_config, model.dtype)
        n_audio = int(extra["audio_lengths"].sum())
    rate = audio_tokens_per_second(cfg.audio_config)
    block = clip_ids(cfg, steps, per_step, n_audio, second_per_grid, rate)
    return block, {
        "pixel_values_videos": pixel_values_videos.to(model.dtype),
        "video_grid_thw": video_grid_thw,
        "second_per_grid_ts": torch.tensor([second_per_grid]),
        **extra,
    }


def token_types(input_ids: torch.Tensor, config: Any) -> torch.Tensor:  # [1, L] -> [1, L] long
    """`mm_token_type_ids`: video 2, audio `AUDIO_TYPE` (3), everything else 0."""
    video = (input_ids == config.video_token_id).long() * 2
    return video + (input_ids == config.audio_token_id).long() * AUDIO_TYPE
