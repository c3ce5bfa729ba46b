"""A word-level tokenizer with Qwen's special tokens and chat template, and processor-shaped inputs.

The tokenizer is built with the `tokenizers` library (WordLevel model, whitespace pre-tokenizer)
and wrapped as `transformers.PreTrainedTokenizerFast`; it is saved next to the checkpoints.

`processor_inputs` builds what Qwen2.5-VL's processor returns for one video and a question: the
chat template renders the user turn with one `<|video_pad|>` placeholder, which is expanded to one
token per merged visual token, exactly as `Qwen2_5_VLProcessor` does. The pixel values come from
`hippo.adapters.qwen2_5_vl.frames_to_pixel_values`, which lays frames out as transformers'
Qwen2-VL video processor does; this project does not use that processor class itself because it
needs torchvision, which has no CPU wheel for the torch version used here.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hippo.adapters.qwen2_5_vl import frames_to_pixel_values
from hippo.cli.pair.narration import NARRATION_WORDS
from hippo.cli.pair.task import CAPTION_WORDS, CLIP_SECONDS, QUESTION
from hippo.cli.pair.tokens import SPECIALS

CHAT_WORDS = ("system", "user", "assistant", "describe", "the", "video", "what", "happens", "?")
VOCAB_SIZE = 64  # embedding rows (the vocabulary proper is smaller; the rest are never produced)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vocabulary() -> dict[str, int]:
    words = list(dict.fromkeys((*CAPTION_WORDS, *CHAT_WORDS, *NARRATION_WORDS)))  # appended: ids only grow
    vocab = {tok: i for i, tok in enumerate((*SPECIALS, *words))}
    assert len(vocab) <= VOCAB_SIZE
    return vocab


def build_tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=list(SPECIALS[1:7]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )
    return tok


def seconds_per_grid(fps: float) -> float:
    return 2.0 / fps  # temporal_patch_size / fps, as Qwen2.5-VL's processor computes it


def messages(question: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]


def prompt_ids(tokenizer, n_video_tokens: int, question: str = QUESTION) -> list[int]:
    """The chat prompt with its one video placeholder expanded to `n_video_tokens` `<|video_pad|>`."""
    text = tokenizer.apply_chat_template(messages(question), tokenize=False, add_generation_prompt=True)
    pad = "<|video_pad|>"
    assert text.count(pad) == 1
    text = text.replace(pad, pad * n_video_tokens)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def caption_ids(tokenizer, caption: str) -> list[int]:  # the caption and the end of the turn
    return tokenizer(caption, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def processor_inputs(
    tokenizer,
    video: torch.Tensor,  # [T, H, W, 3] in [0, 1]
    question: str = QUESTION,
    *,
    fps: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """The mapping `Qwen2_5_VLProcessor(text=..., videos=...)` returns, for batch size 1.

    `fps` defaults to the task's: every clip lasts CLIP_SECONDS, so 8 frames are 2 fps (Qwen's
    default, one temporal grid step per second) and 32 frames are 8 fps; the temporal M-RoPE
    positions then span the same range for any frame count.
    """
    fps = video.shape[0] / CLIP_SECONDS if fps is None else fps
    pixels, grid = frames_to_pixel_values(video)  # [t*h*w, 1176], [1, 3]
    n = int(grid.prod()) // 4  # merged 2x2
    ids = torch.tensor([prompt_ids(tokenizer, n, question)])
    video_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == video_id).long() * 2,
        "pixel_values_videos": pixels.to(dtype),
        "video_grid_thw": grid,
        "second_per_grid_ts": torch.tensor([seconds_per_grid(fps)]),
    }
