"""Tiny random Qwen3-VL models and processor-shaped inputs (timestamps interleaved per frame)."""

from __future__ import annotations

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from hippo.adapters import tiny
from hippo.adapters.qwen2_5_vl import frames_to_pixel_values

#: Two text tokens stand for each frame's "<t seconds>" timestamp in synthetic prompts.
TIMESTAMP = (140, 141)

#: the vision layers whose features also feed the language model (DeepStack), by role
DEEPSTACK = {"target": [0, 1], "draft": [0]}


def tiny_config(role: str = "target") -> Qwen3VLConfig:
    s = tiny.SIZES[role]
    head_dim = s["hidden"] // s["heads"]
    rope = tiny.mrope_parameters(head_dim, mrope_interleaved=True)
    vision = tiny.qwen_vision_config(
        s, 16, num_position_embeddings=64, deepstack_visual_indexes=DEEPSTACK[role]
    )
    return tiny.qwen_config(
        Qwen3VLConfig, tiny.text_config(s, head_dim=head_dim, rope_parameters=rope), vision
    )


def tiny_model(role: str = "target", *, seed: int = 0, dtype: torch.dtype = torch.float32):
    return tiny.seeded_model(Qwen3VLForConditionalGeneration, tiny_config(role), seed, dtype)


def synthetic_inputs(model, video: torch.Tensor, text_before: list[int], text_after: list[int]) -> dict:
    """video [T, H, W, 3] in [0, 1], H and W multiples of 32."""
    vc, cfg = model.config.vision_config, model.config
    pixels, grid = frames_to_pixel_values(video, vc.patch_size, vc.temporal_patch_size, vc.spatial_merge_size)
    t, h, w = grid[0].tolist()
    per_frame = h * w // vc.spatial_merge_size**2
    ids = list(text_before)
    for _ in range(t):
        ids += [
            *TIMESTAMP,
            cfg.vision_start_token_id,
            *[cfg.video_token_id] * per_frame,
            cfg.vision_end_token_id,
        ]
    ids += list(text_after)
    return tiny.qwen_video_inputs(model, ids, pixels, grid)
