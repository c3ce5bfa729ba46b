"""The server's streamed text (`Ticket.put`, decoding only the answer's tail) against decoding the
whole answer at every step, on word-level, byte-level BPE, SentencePiece-style and WordPiece
tokenizers: the same deltas, call by call, stop strings included."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hippo.service import Request, Ticket, _Detokenizer, _first_stop

CORPUS = [
    "the red circle moves left . a green square appears , then it's gone !",
    "naïve café déjà vu — über straße",
    "视频中的红色圆圈向左移动。",
    "emoji 🎥🦛 and 👩‍👩‍👧 families",
    "don't stop ' quoted ' words ? yes .",
    "   spaces  and\ttabs\nnew lines",
]
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|video_pad|>"]


def _wrap(core: Tokenizer, **kw) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=SPECIALS[0],
        eos_token=SPECIALS[1],
        additional_special_tokens=SPECIALS[2:],
        **kw,
    )


@functools.cache
def tokenizer(kind: str) -> PreTrainedTokenizerFast:
    if kind == "word-level":  # the committed pairs' tokenizer
        from hippo.benchmarks.tokenizer import build_tokenizer

        return build_tokenizer()
    if kind == "byte-level-bpe":  # GPT-2 / Qwen: a character's bytes may be split over tokens
        core = Tokenizer(models.BPE())
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        core.train_from_iterator(CORPUS, trainer)
        return _wrap(core)
    if kind == "sentencepiece-bpe":  # LLaMA-style: "▁" for spaces, the first one stripped on decode
        core = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        core.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=200, special_tokens=["<unk>", *SPECIALS, *(f"<0x{b:02X}>" for b in range(256))]
        )
        core.train_from_iterator(CORPUS, trainer)
        return _wrap(core, unk_token="<unk>")
    if kind == "wordpiece-cleanup":  # BERT-style "##" pieces, spaces before punctuation cleaned up
        core = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        core.decoder = decoders.WordPiece(cleanup=True)
        trainer = trainers.WordPieceTrainer(vocab_size=150, special_tokens=["[UNK]", *SPECIALS])
        core.train_from_iterator(CORPUS, trainer)
        return _wrap(core, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    raise ValueError(kind)


KINDS = ("word-level", "byte-level-bpe", "sentencepiece-bpe", "wordpiece-cleanup")


def reference_deltas(tok, chunks, stops):
    """`Ticket.put` as it was: the whole answer decoded at every step. None where one full decode
    does not begin with the text already sent: no stream can take text back, and this one would
    send a wrong delta (WordPiece's clean-up turns `stop ' q` into `stop'q`, a space already sent)."""
    tokens, emitted, out = [], "", []
    for new in chunks:
        tokens += new
        text = tok.decode(tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            out.append(None)
            continue
        if not text.startswith(emitted):
            return None
        cut = _first_stop(text, stops, len(emitted))
        delta, emitted = text[len(emitted) : cut], text[:cut]
        out.append(delta if (delta or new) else None)
        if cut is not None:
            break
    return out, emitted


def ticket_deltas(tok, chunks, stops):
    events = []
    ticket = Ticket(Request(video="v.mp4", turns=[("q", None)], stop=stops), tok, events.append)
    ticket.put(torch.tensor([1, 2, 3]))  # the prompt: skipped
    out = []
    for new in chunks:
        before = len(events)
        ticket.put(torch.tensor(new, dtype=torch.long))
        out.append(events[-1][1] if len(events) > before else None)
        assert all(e[2] for e in events[before:]) or not new
        if ticket.stopped:
            break
    return out, ticket.text


@st.composite
def answers(draw, kind):
    tok = tokenizer(kind)
    n_vocab = len(tok)
    ids = draw(st.lists(st.integers(0, n_vocab - 1), min_size=0, max_size=60))
    # text-like runs too: the tokens of a corpus line, so that merges and multi-byte characters occur
    if draw(st.booleans()):
        line = draw(st.sampled_from(CORPUS))
        ids = tok(line, add_special_tokens=False)["input_ids"] + ids
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=12)))
    chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    text = tok.decode(ids, skip_special_tokens=True)
    stops = draw(
        st.lists(
            st.one_of(st.text(min_size=1, max_size=3), st.just(text[len(text) // 2 : len(text) // 2 + 2])),
            max_size=2,
        )
    )
    return chunks, [s for s in stops if s]


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_text_is_the_full_decodes(kind):
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=answers(kind))
    def check(case):
        chunks, stops = case
        tok = tokenizer(kind)
        expected = reference_deltas(tok, chunks, stops)
        if expected is not None:
            assert ticket_deltas(tok, chunks, stops) == expected
        else:  # the decoder rewrote sent text: the stream still carries every token's own delta
            assert kind == "wordpiece-cleanup"

    check()


@pytest.mark.parametrize("kind", KINDS)
def test_each_step_decodes_the_tail_only(kind):
    """A 3,000-token answer, one token a step: every decode reads at most the new tokens and CONTEXT
    before them (plus special tokens among them), not the answer."""
    tok = tokenizer(kind)
    words = [
        i
        for i in tok(" ".join(CORPUS), add_special_tokens=False)["input_ids"]
        if i not in tok.all_special_ids
    ]
    if kind == "word-level":  # its own words (the corpus is mostly unknown to it)
        words = tok(" ".join(tok.get_vocab())[:2000], add_special_tokens=False)["input_ids"]
        words = [i for i in words if i not in tok.all_special_ids]
    ids = (words * 3000)[:3000]
    ids[100:100] = tok.all_special_ids[:2]  # special tokens (decoded as nothing) amid the answer
    lengths = []
    detok = _Detokenizer(tok)
    decode = tok.decode
    tok.decode = lambda x, **kw: (lengths.append(len(x)), decode(x, **kw))[1]
    try:
        text = ""
        for n in range(1, len(ids) + 1):
            delta = detok.step(ids[:n])
            text += delta or ""
    finally:
        del tok.decode
    expected = reference_deltas(tok, [[i] for i in ids], [])
    if expected is not None:  # prefix-stable decoding (not WordPiece's clean-up): the whole text
        assert text == expected[1] == decode(ids, skip_special_tokens=True)
    longest_stall = 8  # tokens a character's bytes may be split over, at most, in these tokenizers
    assert max(lengths) <= _Detokenizer.CONTEXT + longest_stall
