"""Questions about a prepared video: the prompt tokens that follow the cached prefix.

A question is token ids (appended as they are) or text (rendered through the tokenizer's chat
template: the user turn holding the video and the question, earlier turns included, then the
generation prompt; the tokens after the video's last placeholder are the question's). A
`Conversation` keeps the turns, so each answer is conditioned on the earlier questions and
answers exactly as `target.generate` on the whole conversation prompt would be.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hippo.errors import InputError, ModelError
from hippo.types import GenerateOutput

#: a prepared video (`hippo.context.VideoContext`: its tokenizer and pipeline), and the
#: `hippo.pipeline.Pipeline` that answers (`ask_ids`); both sit above this module
VideoContext = Pipeline = Any

Question = str | Sequence[int] | torch.Tensor


def as_ids(question: Sequence[int] | torch.Tensor) -> torch.Tensor:  # -> [k] long
    ids = torch.as_tensor(question, dtype=torch.long).cpu()
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise InputError(f"a question's token ids must be [k] or [1, k], got shape {tuple(ids.shape)}")
    return ids


class Prompt(str):
    """A prompt with a system turn: the chat template renders `system` as the system message before
    the user turn (`hippo.media.inputs.chat_text`, `messages`). A plain str has none, so it passes
    through every adapter's `build_inputs` unchanged."""

    system: str | None

    def __new__(cls, text: str, system: str | None = None) -> Prompt:
        obj = super().__new__(cls, text)
        obj.system = system
        return obj


def system_message(system: str | None) -> list[dict[str, Any]]:
    """The system turn's message (none for None or an empty text)."""
    return [{"role": "system", "content": system}] if system else []


def messages(turns: Sequence[tuple[str, str | None]], system: str | None = None) -> list[dict[str, Any]]:
    """Chat messages: the system turn (if any), then the first user turn holds the video; each
    answered turn adds the answer."""
    out: list[dict[str, Any]] = system_message(system)
    for i, (question, answer) in enumerate(turns):
        content: list[dict[str, Any]] = [{"type": "video"}] if i == 0 else []
        out.append({"role": "user", "content": [*content, {"type": "text", "text": question}]})
        if answer is not None:
            out.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return out


def text_question_ids(
    ctx: VideoContext, turns: Sequence[tuple[str, str | None]], system: str | None = None
) -> torch.Tensor:  # -> [k]
    """The tokens after the video's last placeholder in the chat template's rendering of `turns`
    (after the `system` turn: the context must have been prepared with the same one)."""
    tok = ctx.tokenizer
    if tok is None:
        raise InputError(
            "a text question needs a tokenizer: prepare the context from a video file, or pass "
            "tokenizer= to Pipeline.prepare (else ask with token ids)"
        )
    if not turns[-1][0] or not turns[-1][0].strip():
        raise InputError("the question is empty; type a question about the video")
    if not getattr(tok, "chat_template", None):
        raise ModelError("the tokenizer has no chat template; use the checkpoint's own tokenizer files")
    text = tok.apply_chat_template(messages(turns, system), add_generation_prompt=True, tokenize=False)
    video = getattr(ctx.pipeline.target.config, "video_token_id", None)
    placeholder = (
        tok.convert_ids_to_tokens(int(video)) if isinstance(video, int) and video < len(tok) else None
    )
    if not placeholder or placeholder not in text:
        raise ModelError(
            f"the chat template does not render the video placeholder {placeholder!r} (token {video}); use "
            "the checkpoint's own tokenizer"
        )
    tail = text[text.rindex(placeholder) + len(placeholder) :]
    return tok(tail, add_special_tokens=False, return_tensors="pt")["input_ids"][0]


class Conversation:
    """Turns about one prepared video; `ask` answers the next question given the earlier turns.

    Questions are all text or all token ids. Text turns go through the chat template (the answer
    is put back as its decoded text); token-id turns are appended as they are: the prompt of turn
    n is prefix + q1 + a1 + ... + qn, where a_i are the generated ids (EOS included).
    """

    def __init__(self, pipeline: Pipeline, ctx: VideoContext):
        self.pipeline, self.ctx = pipeline, ctx
        self.turns: list[tuple[Question, list[int]]] = []

    def _ids(self, question: Question) -> torch.Tensor:  # -> [k] the tokens after the prefix
        text = isinstance(question, str)
        if self.turns and isinstance(self.turns[0][0], str) != text:
            raise InputError("a conversation's questions are all text or all token ids; start a new one")
        if text:
            tok = self.ctx.tokenizer
            done = [(q, tok.decode(a, skip_special_tokens=True)) for q, a in self.turns]
            return text_question_ids(self.ctx, [*done, (question, None)])
        parts = [t for q, a in self.turns for t in (as_ids(q), torch.tensor(a, dtype=torch.long))]
        return torch.cat([*parts, as_ids(question)])

    def ask(self, question: Question, **generation_kwargs: Any) -> GenerateOutput:
        """Answer `question` after the earlier turns; returns what `Pipeline.generate` returns."""
        out = self.pipeline.ask_ids(self.ctx, self._ids(question), **generation_kwargs)
        L = out.sequences.shape[1] - out.stats.new_tokens
        self.turns.append((question, out.sequences[0, L:].tolist()))
        return out

    def reset(self) -> None:
        """Forget the turns (the video context stays)."""
        self.turns = []
