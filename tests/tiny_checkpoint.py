"""Tiny checkpoints on disk for the `hippo generate` tests: random tiny models saved with
`save_pretrained`, a word-level tokenizer with a chat template saved next to them, and a short video.

The tokenizer's 160 ids match the tiny models' vocabulary and special ids (adapters/qwen2_5_vl_tiny.py:
BOS 1, EOS 2, vision start/end 150/151, image 152, video 153). Words are split on whitespace and
punctuation and digits one by one, so Qwen3-VL's "<1.5 seconds>" timestamps tokenize too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SPECIAL = {
    "<pad>": 0,
    "<s>": 1,
    "</s>": 2,
    "<unk>": 3,
    "<|im_start|>": 4,
    "<|im_end|>": 5,
    "<|vision_start|>": 150,
    "<|vision_end|>": 151,
    "<|image_pad|>": 152,
    "<|video_pad|>": 153,
}
WORDS = (
    "user assistant system describe the video what happens in this a an is are and of to there red blue "
    "square squares moving left right up down frame frames seconds bar bright dark < > . , ? ! : "
    "0 1 2 3 4 5 6 7 8 9"
).split()
VOCAB = 160

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def vocabulary(shift: int = 0) -> dict[str, int]:
    """token -> id; `shift` rotates the plain words' ids (a different tokenizer, same size)."""
    vocab = dict(SPECIAL)
    free = [i for i in range(VOCAB) if i not in SPECIAL.values()]
    words = [*WORDS, *(f"w{i}" for i in range(len(free) - len(WORDS)))]
    free = free[shift:] + free[:shift]
    vocab.update(zip(words, free))
    assert sorted(vocab.values()) == list(range(VOCAB))
    return vocab


def tiny_tokenizer(shift: int = 0, extra_special: dict[str, int] | None = None):
    """The word-level tokenizer; `extra_special` turns the words at those ids into special tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    extra = extra_special or {}
    by_id = {i: t for t, i in extra.items()}
    vocab = {by_id.get(i, t): i for t, i in vocabulary(shift).items()}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    specials = [*SPECIAL, *extra]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def save_checkpoint(
    path: Path,
    adapter: str = "qwen2_5_vl",
    role: str = "target",
    seed: int = 0,
    tokenizer: bool = True,
    shift: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A tiny random model of `adapter` (+ the tiny tokenizer) saved into `path`; it loads back in
    the `dtype` it was saved in. Float64 where a test compares tokens with `target.generate`
    exactly (float32 equality is not guaranteed), float32 where it checks loading or the CLI."""
    from hippo.registry import lookup

    model = lookup("adapters", adapter).tiny_model(role, seed=seed, dtype=dtype)
    model.save_pretrained(path)
    if tokenizer:
        tiny_tokenizer(shift).save_pretrained(path)
    return path


def write_video(
    path: Path, n: int = 16, fps: int = 8, size: tuple[int, int] = (64, 64), audio: bool = False
) -> Path:
    """A short mpeg4 clip (a bright bar moving right over a dark frame), optionally with a 440 Hz tone."""
    import av

    h, w = size
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        a = c.add_stream("aac", rate=16000) if audio else None
        c.start_encoding()  # the header, even for a clip of n=0 frames
        for i in range(n):
            f = np.zeros((h, w, 3), np.uint8)
            f[:, (i * 3) % w : (i * 3) % w + 8] = 255
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
        if a is not None:
            t = np.arange(int(16000 * n / fps)) / 16000
            tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None]
            for start in range(0, tone.shape[1], 1024):
                frame = av.AudioFrame.from_ndarray(
                    tone[:, start : start + 1024], format="fltp", layout="mono"
                )
                frame.sample_rate = 16000
                for p in a.encode(frame):
                    c.mux(p)
            for p in a.encode():
                c.mux(p)
    return path
