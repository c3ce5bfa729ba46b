"""Configurations of the benchmark pair: a small target and a smaller draft, both the stock
`Qwen2_5_VLForConditionalGeneration` with a 64-row vocabulary.

The vision encoder uses windowed attention only (windows of 112 px), so each visual token's
features depend on its neighbourhood and not on the frame size; the language model reads every
visual token through M-RoPE positions as transformers computes them.
"""

from __future__ import annotations

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from hippo.benchmarks.tokenizer import SPECIALS, VOCAB_SIZE

IDS = {tok: i for i, tok in enumerate(SPECIALS)}
BOS, EOS, PAD = IDS["<|endoftext|>"], IDS["<|im_end|>"], IDS["<|endoftext|>"]

SIZES = {
    "target": dict(
        hidden=128, layers=4, heads=2, kv_heads=1, ffn=384, vit_hidden=64, vit_depth=2, vit_ffn=128
    ),
    "draft": dict(hidden=64, layers=2, heads=2, kv_heads=1, ffn=192, vit_hidden=32, vit_depth=1, vit_ffn=64),
}


def mrope_section(head_dim: int) -> list[int]:
    """Split head_dim / 2 rotary frequencies over (t, h, w) as Qwen2.5-VL does (16, 24, 24 of 64)."""
    half = head_dim // 2
    hw = (half * 3) // 8
    return [half - 2 * hw, hw, hw]


def pair_config(role: str = "target", **overrides) -> Qwen2_5_VLConfig:
    s = {**SIZES[role], **overrides}
    head_dim = s["hidden"] // s["heads"]
    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=s["hidden"],
        intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": mrope_section(head_dim),
        },
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    vision = dict(
        depth=s["vit_depth"],
        hidden_size=s["vit_hidden"],
        intermediate_size=s["vit_ffn"],
        num_heads=2,
        out_hidden_size=s["hidden"],
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=list(s.get("vit_full", [])),
        tokens_per_second=2,
    )
    cfg = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IDS["<|image_pad|>"],
        video_token_id=IDS["<|video_pad|>"],
        vision_start_token_id=IDS["<|vision_start|>"],
        vision_end_token_id=IDS["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = BOS, EOS, PAD
    return cfg


def new_model(role: str, seed: int, **overrides) -> Qwen2_5_VLForConditionalGeneration:
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(pair_config(role, **overrides))
    set_generation_defaults(model)
    return model


def set_generation_defaults(model) -> None:
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = BOS, EOS, PAD
    gc.do_sample = False
    gc.max_new_tokens = 32


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
