"""The pieces the tiny random models of every backbone share: target/draft sizes, the language model's
config, the Qwen vision tower's config and its M-RoPE split, and seeding a model with its generation ids.

Each backbone's `*_tiny` module keeps its own transformers config and model classes; this module only
builds the keyword dictionaries they take. `hippo.benchmarks.models` builds its trained pair's
configuration from the same pieces.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 160
BOS, EOS, PAD = 1, 2, 0
VISION_START, VISION_END, IMAGE, VIDEO = 150, 151, 152, 153

#: the tiny models' sizes: language model (hidden, layers, heads, kv_heads, ffn), vision tower (vit_*)
SIZES = {
    "target": dict(hidden=64, layers=3, heads=4, kv_heads=2, ffn=128, vit_hidden=32, vit_depth=2),
    "draft": dict(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64, vit_hidden=16, vit_depth=1),
}


def mrope_section(head_dim: int) -> list[int]:
    """Split head_dim / 2 rotary frequencies over (t, h, w) as Qwen2.5-VL does (16, 24, 24 of 64)."""
    half = head_dim // 2
    hw = (half * 3) // 8
    return [half - 2 * hw, hw, hw]


def mrope_parameters(head_dim: int, **extra: Any) -> dict[str, Any]:
    """The text config's `rope_parameters`: M-RoPE with theta 10000 (`extra`: e.g. mrope_interleaved)."""
    return {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section(head_dim), **extra}


def text_config(
    s: dict[str, Any],  # sizes: hidden, ffn, layers, heads, kv_heads
    vocab: int = VOCAB,
    ids: tuple[int, int, int] = (BOS, EOS, PAD),  # bos, eos, pad
    max_positions: int = 4096,
    **extra: Any,
) -> dict[str, Any]:
    """The language model's config keywords; `extra` adds the backbone's own (rope, head_dim, ...)."""
    bos, eos, pad = ids
    return dict(
        vocab_size=vocab,
        hidden_size=s["hidden"],
        intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=max_positions,
        **extra,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )


def qwen_vision_config(s: dict[str, Any], patch_size: int, **extra: Any) -> dict[str, Any]:
    """The Qwen-VL vision tower's config keywords (merge 2x2, 2 frames per temporal patch, 2 heads);
    its MLP is `vit_ffn` wide, else twice `vit_hidden`."""
    return dict(
        depth=s["vit_depth"],
        hidden_size=s["vit_hidden"],
        intermediate_size=s.get("vit_ffn", 2 * s["vit_hidden"]),
        num_heads=2,
        out_hidden_size=s["hidden"],
        patch_size=patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
        **extra,
    )


def qwen_config(
    config_class: type,
    text: dict[str, Any],
    vision: dict[str, Any],
    media: tuple[int, int, int, int] = (IMAGE, VIDEO, VISION_START, VISION_END),  # image, video, start, end
) -> Any:
    """A Qwen-VL config (`config_class`: Qwen2_5_VLConfig, Qwen3VLConfig) with untied embeddings."""
    image, video, start, end = media
    return config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
    )


def seeded_model(
    model_class: type,
    config: Any,
    seed: int,
    dtype: torch.dtype = torch.float32,
    ids: tuple[int, int, int] = (BOS, EOS, PAD),  # bos, eos, pad of generate()
) -> Any:
    """`model_class(config)` with weights drawn under `seed`, in `dtype`, in eval mode."""
    torch.manual_seed(seed)
    model = model_class(config).to(dtype).eval()
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = ids
    return model


def qwen_video_inputs(
    model: Any,
    ids: list[int],
    pixels: torch.Tensor,
    grid: torch.Tensor,  # pixels [P, C], grid [1, 3]
) -> dict[str, Any]:
    """What a Qwen-VL processor returns for the prompt `ids` with one video: the video tokens are of type 2."""
    input_ids = torch.tensor([ids])  # [1, L]
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == model.config.video_token_id).long() * 2,
        "pixel_values_videos": pixels.to(model.dtype),
        "video_grid_thw": grid,
    }
