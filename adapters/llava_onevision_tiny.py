"""Tiny random LLaVA-OneVision models and processor-shaped video inputs."""

from __future__ import annotations

import torch
from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

from hippo.adapters.tiny import BOS, EOS, IMAGE, PAD, SIZES, VIDEO, VOCAB, seeded_model, text_config

MEAN = torch.tensor([0.5, 0.5, 0.5])
STD = torch.tensor([0.5, 0.5, 0.5])
IMAGE_SIZE, PATCH = 112, 14  # 8x8 patches, pooled to 4x4 = 16 tokens per frame


def tiny_config(
    role: str = "target",
    *,
    sizes: dict | None = None,  # default SIZES[role]
    vocab: int = VOCAB,
    ids: tuple[int, int, int] = (BOS, EOS, PAD),  # bos, eos, pad
    media: tuple[int, int] = (IMAGE, VIDEO),  # image and video placeholder ids
    image_size: int = IMAGE_SIZE,
) -> LlavaOnevisionConfig:
    """A small stock LLaVA-OneVision config (Qwen2 language model, SigLIP tower, patch 14)."""
    s = sizes or SIZES[role]
    text = text_config(s, vocab, ids, model_type="qwen2")
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
    return seeded_model(LlavaOnevisionForConditionalGeneration, tiny_config(role), seed, dtype)


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
