"""The word-level tokenizer, its chat template, and processor-shaped inputs."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerFast

from hippo.benchmarks.tokenizer import build_tokenizer, messages, processor_inputs
from hippo.cli.pair.task import CLIP_SECONDS, TaskConfig, sample


def test_caption_round_trips(tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    for t in (tok, PreTrainedTokenizerFast.from_pretrained(tmp_path)):
        for seed in range(10):
            caption = sample(seed).caption
            ids = t(caption, add_special_tokens=False)["input_ids"]
            assert t.unk_token_id not in ids
            assert t.decode(ids) == caption


def test_chat_template_has_one_video_placeholder():
    tok = build_tokenizer()
    text = tok.apply_chat_template(messages(), tokenize=False, add_generation_prompt=True)
    assert text.count("<|video_pad|>") == 1
    assert text.startswith("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_processor_inputs_expand_the_placeholder_per_merged_token():
    tok = build_tokenizer()
    cfg = TaskConfig(size=168, frames=12)
    inputs = processor_inputs(tok, sample(0, cfg).video)
    video = tok.convert_tokens_to_ids("<|video_pad|>")
    ids = inputs["input_ids"][0]
    assert int((ids == video).sum()) == cfg.visual_tokens == 6 * 6 * 6
    assert torch.equal(inputs["mm_token_type_ids"][0] == 2, ids == video)
    assert inputs["video_grid_thw"].tolist() == [[6, 12, 12]]
    assert inputs["pixel_values_videos"].shape == (6 * 12 * 12, 3 * 2 * 14 * 14)
    # every clip lasts CLIP_SECONDS: 12 frames are 3 fps, so one temporal grid step (2 frames) is 2/3 s
    assert inputs["second_per_grid_ts"].tolist() == [torch.tensor(2.0 * CLIP_SECONDS / 12).item()]
