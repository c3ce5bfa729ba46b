"""Tiny random video-SALMONN 2+ models and processor-shaped audio-visual inputs.

Tiny-config scaling: Whisper's chunk is 2 s instead of 30 s (200 mel frames, max_source_positions
100). The rates are the real ones: 100 mel frames and 50 encoder frames per second, 0.5 s windows of
25 frames, 1 query each, so 2 audio tokens per second and 4 per chunk (60 per 30 s chunk for real).
The mel bins stay 128. Everything else is the tiny Qwen2.5-VL of `qwen2_5_vl_tiny`.
"""

from __future__ import annotations

import torch

from hippo.adapters.qwen2_5_vl import frames_to_pixel_values
from hippo.adapters.qwen2_5_vl_tiny import tiny_config as qwen_tiny_config
from hippo.adapters.tiny import seeded_model
from hippo.adapters.video_salmonn2_plus_inputs import clip_inputs, token_types
from hippo.adapters.video_salmonn2_plus_model import (
    SAMPLE_RATE,
    VideoSalmonn2PlusConfig,
    VideoSalmonn2PlusForConditionalGeneration,
)

AUDIO = 154  # <|audio_pad|> of the tiny vocabulary (150-153 are the vision ids)
#: Seconds per temporal grid step of synthetic videos: 0.75 s (2 frames at 8/3 fps), so that
#: f(j) = floor(2·j·0.75) = 0, 1, 3, 4, 6... splits the audio unevenly (n_j = 1, 2, 1, 2, ...) and the
#: "training" temporal positions floor(2·j·0.75) exercise the floor.
SECOND_PER_GRID = 0.75

AUDIO_SIZES = {
    "target": dict(d_model=16, layers=1, heads=2, ffn=32, q_hidden=16, q_layers=2, q_heads=2, q_ffn=32),
    "draft": dict(d_model=8, layers=1, heads=1, ffn=16, q_hidden=8, q_layers=1, q_heads=1, q_ffn=16),
}


def tiny_config(role: str = "target", positions: str = "released") -> VideoSalmonn2PlusConfig:
    base = qwen_tiny_config(role)
    a = AUDIO_SIZES[role]
    audio = dict(
        num_mel_bins=128,
        encoder_layers=a["layers"],
        encoder_attention_heads=a["heads"],
        encoder_ffn_dim=a["ffn"],
        d_model=a["d_model"],
        chunk_length=2,
        max_source_positions=100,
        qformer_config=dict(
            hidden_size=a["q_hidden"],
            num_hidden_layers=a["q_layers"],
            num_attention_heads=a["q_heads"],
            intermediate_size=a["q_ffn"],
            encoder_width=a["d_model"],
        ),
    )
    cfg = VideoSalmonn2PlusConfig(
        text_config=base.text_config.to_dict(),
        vision_config=base.vision_config.to_dict(),
        audio_config=audio,
        image_token_id=base.image_token_id,
        video_token_id=base.video_token_id,
        vision_start_token_id=base.vision_start_token_id,
        vision_end_token_id=base.vision_end_token_id,
        audio_token_id=AUDIO,
        tie_word_embeddings=False,
        positions=positions,
    )
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = base.bos_token_id, base.eos_token_id, 0
    return cfg


def tiny_model(
    role: str = "target", *, seed: int = 0, dtype: torch.dtype = torch.float32, positions: str = "released"
) -> VideoSalmonn2PlusForConditionalGeneration:
    return seeded_model(VideoSalmonn2PlusForConditionalGeneration, tiny_config(role, positions), seed, dtype)


def synthetic_audio(video: torch.Tensor, seconds: float) -> torch.Tensor:  # -> [S] float32 at 16 kHz
    """A deterministic waveform for a synthetic video: noise seeded by the frames' content."""
    seed = int(abs(float(video.double().sum())) * 1000) % 2**31
    g = torch.Generator().manual_seed(seed)
    return 0.1 * torch.randn(max(1, round(seconds * SAMPLE_RATE)), generator=g)


def synthetic_inputs(
    model,
    video: torch.Tensor,  # [T, H, W, 3] in [0, 1]
    text_before: list[int],
    text_after: list[int],
    audio: torch.Tensor | bool | None = None,
    second_per_grid: float = SECOND_PER_GRID,
) -> dict:
    """Inputs as the released data pipeline builds them.

    `audio`: a 16 kHz mono waveform [S]; None: a synthetic one as long as the video (T frames at
    temporal_patch / second_per_grid fps); False: no audio (the stock Qwen2.5-VL video layout).
    `mm_token_type_ids` marks video 2 and audio `AUDIO_TYPE` (3).
    """
    vc = model.config.vision_config
    pixels, grid = frames_to_pixel_values(video, vc.patch_size, vc.temporal_patch_size, vc.spatial_merge_size)
    if audio is None:
        audio = synthetic_audio(video, video.shape[0] * second_per_grid / vc.temporal_patch_size)
    block, extra = clip_inputs(model, pixels, grid, second_per_grid, None if audio is False else audio)
    input_ids = torch.tensor([[*text_before, *block, *text_after]])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": token_types(input_ids, model.config),
        **extra,
    }
