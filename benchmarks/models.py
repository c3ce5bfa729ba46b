"""Configurations of the benchmark pair: a small target and a smaller draft, both the stock
`Qwen2_5_VLForConditionalGeneration` with a 64-row vocabulary.

The vision encoder uses windowed attention only (windows of 112 px), so each visual token's
features depend on its neighbourhood and not on the frame size; the language model reads every
visual token through M-RoPE positions as transformers computes them.
"""

from __future__ import annotations

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from hippo.adapters.tiny import mrope_parameters, qwen_config, qwen_vision_config, text_config
from hippo.benchmarks.tokenizer import VOCAB_SIZE
from hippo.cli.pair.tokens import BOS, EOS, IDS, PAD, set_generation_defaults

SIZES = {
    "target": dict(
        hidden=128, layers=4, heads=2, kv_heads=1, ffn=384, vit_hidden=64, vit_depth=2, vit_ffn=128
    ),
    "draft": dict(hidden=64, layers=2, heads=2, kv_heads=1, ffn=192, vit_hidden=32, vit_depth=1, vit_ffn=64),
}


def pair_config(role: str = "target", **overrides) -> Qwen2_5_VLConfig:
    s = {**SIZES[role], **overrides}
    rope = mrope_parameters(s["hidden"] // s["heads"])
    text = text_config(s, VOCAB_SIZE, (BOS, EOS, PAD), 32768, rms_norm_eps=1e-6, rope_parameters=rope)
    vision = qwen_vision_config(
        s, 14, window_size=112, fullatt_block_indexes=list(s.get("vit_full", [])), tokens_per_second=2
    )
    media = tuple(IDS[t] for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"))
    cfg = qwen_config(Qwen2_5_VLConfig, text, vision, media)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = BOS, EOS, PAD
    return cfg


def new_model(role: str, seed: int, **overrides) -> Qwen2_5_VLForConditionalGeneration:
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(pair_config(role, **overrides))
    set_generation_defaults(model)
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
