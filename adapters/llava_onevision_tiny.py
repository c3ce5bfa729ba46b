"""Tiny random LLaVA-OneVision models and processor-shaped video inputs."""

from __future__ import annotations

import torch
from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

from hippo.adapters.qwen2_5_vl_tiny import BOS, EOS, IMAGE, VIDEO, VOCAB

MEAN = torch.tensor([0.5, 0.5, 0.5])
STD = torch.tensor([0.5, 0.5, 0.5])
SIZES = {
    "target": dict(hidden=64, layers=3, heads=4, kv_heads=2, ffn=128, vit_hidden=32, vit_depth=2),
    "draft": dict(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64, vit_hidden=16, vit_depth=1),
}
IMAGE_SIZE, PATCH = 112, 14  # 8x8 patches, pooled to 4x4 = 16 tokens per frame


def tiny_config(
    role: str = "target",
    *,
    sizes: dict | None = None,  # default SIZES[role]
    vocab: int = VOCAB,
    ids: tuple[int, int, int] = (BOS, EOS, 0),  # bos, eos, pad
    media: tuple[int, int] = (IMAGE, VIDEO),  # image and video placeholder ids
    image_size: int = IMAGE_SIZE,
) -> LlavaOnevisionConfig:
    """A small stock LLaVA-OneVision config (Qwen2 language model, SigLIP tower, patch 14)."""
    s = sizes or SIZES[role]
    bos, eos, pad = ids
    text = dict(
        model_type="qwen2",
        vocab_size=vocab,
        hidden_size=s["hidden"],
        intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=4096,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=s["vit_hidden"],
        intermediate_size=2 * s["vit_hidden"],
        num_hidden_layers=s["vit_depth"],
        num_attention_heads=2,
        image_size=image_size,
        patch_size=PATCH,
        vision_use_head=False,
    )
    return LlavaOnevisionConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=media[0],
        video_token_index=media[1],
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        tie_word_embeddings=False,
    )


def tiny_model(role: str = "target", *, seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(tiny_config(role)).to(dtype).eval()
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = BOS, EOS, 0
    return model


def synthetic_inputs(model, video: torch.Tensor, text_before: list[int], text_after: list[int]) -> dict:
    """video [T, H, W, 3] in [0, 1]; frames are resized to the vision tower's square input."""
    size = model.config.vision_config.image_size
    x = video.float().permute(0, 3, 1, 2)  # [T, 3, H, W]
    if x.shape[-2:] != (size, size):
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = (x - MEAN[:, None, None]) / STD[:, None, None]
    side = -(-(size // model.config.vision_config.patch_size) // 2)
    n = x.shape[0] * side * side + 1  # + the newline token
    ids = torch.tensor([[*text_before, *[model.config.video_token_id] * n, *text_after]])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values_videos": x[None].to(model.dtype),
    }
