"""Tiny random Qwen2.5-VL models and processor-shaped inputs built from raw frames.

The pixel layout is the adapter's (`hippo.adapters.qwen2_5_vl.frames_to_pixel_values`).
"""

from __future__ import annotations

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from hippo.adapters.qwen2_5_vl import frames_to_pixel_values

VOCAB = 160
BOS, EOS = 1, 2
VISION_START, VISION_END, IMAGE, VIDEO = 150, 151, 152, 153

SIZES = {
    "target": dict(hidden=64, layers=3, heads=4, kv_heads=2, ffn=128, vit_hidden=32, vit_depth=2),
    "draft": dict(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64, vit_hidden=16, vit_depth=1),
}


def tiny_config(role: str = "target") -> Qwen2_5_VLConfig:
    s = SIZES[role]
    head_dim = s["hidden"] // s["heads"]
    quarter = head_dim // 2 // 4  # mrope_section must sum to head_dim / 2
    section = [head_dim // 2 - 2 * quarter * 3 // 2, quarter * 3 // 2, quarter * 3 // 2]
    text = dict(
        vocab_size=VOCAB,
        hidden_size=s["hidden"],
        intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    vision = dict(
        depth=s["vit_depth"],
        hidden_size=s["vit_hidden"],
        intermediate_size=2 * s["vit_hidden"],
        num_heads=2,
        out_hidden_size=s["hidden"],
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[0],
        tokens_per_second=2,
    )
    cfg = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = BOS, EOS, 0
    return cfg


def tiny_model(role: str = "target", *, seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(role)).to(dtype).eval()
    model.generation_config.bos_token_id = BOS
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    return model


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
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == cfg.video_token_id).long() * 2,
        "pixel_values_videos": pixels.to(model.dtype),
        "video_grid_thw": grid,
        "second_per_grid_ts": torch.tensor([1.0]),
    }
