"""Tiny random Qwen2.5-VL models and processor-shaped inputs built from raw frames.

The pixel layout is the adapter's (`hippo.adapters.qwen2_5_vl.frames_to_pixel_values`).
"""

from __future__ import annotations

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from hippo.adapters import tiny
from hippo.adapters.qwen2_5_vl import frames_to_pixel_values


def tiny_config(role: str = "target") -> Qwen2_5_VLConfig:
    s = tiny.SIZES[role]
    rope = tiny.mrope_parameters(s["hidden"] // s["heads"])
    vision = tiny.qwen_vision_config(s, 14, window_size=56, fullatt_block_indexes=[0], tokens_per_second=2)
    cfg = tiny.qwen_config(Qwen2_5_VLConfig, tiny.text_config(s, rope_parameters=rope), vision)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tiny.BOS, tiny.EOS, tiny.PAD
    return cfg


def tiny_model(role: str = "target", *, seed: int = 0, dtype: torch.dtype = torch.float32):
    return tiny.seeded_model(Qwen2_5_VLForConditionalGeneration, tiny_config(role), seed, dtype)


def synthetic_inputs(model, video: torch.Tensor, text_before: list[int], text_after: list[int]) -> dict:
    vc = model.config.vision_config
    pixels, grid = frames_to_pixel_values(video, vc.patch_size, vc.temporal_patch_size, vc.spatial_merge_size)
    n_video = int(grid.prod()) // vc.spatial_merge_size**2
    cfg = model.config
    ids = [
        *text_before,
        cfg.vision_start_token_id,
        *[cfg.video_token_id] * n_video,
        cfg.vision_end_token_id,
        *text_after,
    ]
    return {**tiny.qwen_video_inputs(model, ids, pixels, grid), "second_per_grid_ts": torch.tensor([1.0])}
