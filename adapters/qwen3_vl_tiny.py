"""Tiny random Qwen3-VL models and processor-shaped inputs (timestamps interleaved per frame)."""

from __future__ import annotations

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from hippo.adapters.qwen2_5_vl import frames_to_pixel_values
from hippo.adapters.qwen2_5_vl_tiny import (
    BOS,
    EOS,
    IMAGE,
    VIDEO,
    VISION_END,
    VISION_START,
    VOCAB,
)

#: Two text tokens stand for each frame's "<t seconds>" timestamp in synthetic prompts.
TIMESTAMP = (140, 141)

SIZES = {
    "target": dict(
        hidden=64, layers=3, heads=4, kv_heads=2, ffn=128, vit_hidden=32, vit_depth=2, deepstack=[0, 1]
    ),
    "draft": dict(
        hidden=32, layers=1, heads=2, kv_heads=1, ffn=64, vit_hidden=16, vit_depth=1, deepstack=[0]
    ),
}


def tiny_config(role: str = "target") -> Qwen3VLConfig:
    s = SIZES[role]
    head_dim = s["hidden"] // s["heads"]
    half = head_dim // 2  # mrope_section must sum to head_dim / 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    text = dict(
        vocab_size=VOCAB,
        hidden_size=s["hidden"],
        intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": section,
            "mrope_interleaved": True,
        },
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
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=s["deepstack"],
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )


def tiny_model(role: str = "target", *, seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(tiny_config(role)).to(dtype).eval()
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = BOS, EOS, 0
    return model


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
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == cfg.video_token_id).long() * 2,
        "pixel_values_videos": pixels.to(model.dtype),
        "video_grid_thw": grid,
    }
