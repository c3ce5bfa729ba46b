"""The special tokens of the pair's word-level tokenizer (Qwen's, first in its vocabulary), and the
generate() defaults its checkpoints carry."""

from __future__ import annotations

SPECIALS = (
    "<|endoftext|>",  # bos and pad, as in Qwen
    "<|im_start|>",
    "<|im_end|>",  # eos
    "<|vision_start|>",
    "<|vision_end|>",
    "<|video_pad|>",
    "<|image_pad|>",
    "<unk>",
)
IDS = {tok: i for i, tok in enumerate(SPECIALS)}
BOS, EOS, PAD = IDS["<|endoftext|>"], IDS["<|im_end|>"], IDS["<|endoftext|>"]


def set_generation_defaults(model) -> None:
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = BOS, EOS, PAD
    gc.do_sample = False
    gc.max_new_tokens = 32
