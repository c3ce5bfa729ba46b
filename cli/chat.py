"""`hippo chat`: many questions about one video, the video encoded and prefilled once.

The video's shared prefix (vision features and the target's KV up to the end of the video) is built
once by `Pipeline.prepare`; each question then runs on its own extension of it (`Pipeline.ask`, or a
`Conversation` whose answers see the earlier turns), losslessly. Interactive by default; with
`--questions FILE` every line is answered independently, for scripts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hippo.builder import PipelineBuilder
from hippo.cli.video_commands import (
    StageBars,
    check_output,
    generation_kwargs,
    pipeline_config,
    prepare,
    quiet_transformers,
    say,
    text_streamer,
    write_json,
)
from hippo.errors import ConfigError, HippoError, InputError, one_line
from hippo.registry import lookup

HELP = "type a question; /stats, /reset (forget earlier turns; the video stays prepared), /quit"


def read_questions(path: str) -> list[str]:
    """The non-blank lines of a questions file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"--questions {path!r} is not a file; pass a text file with one question per line")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read --questions {path!r} as UTF-8 text ({exc})") from None
    questions = [line.strip() for line in lines if line.strip()]
    if not questions:
        raise ConfigError(f"--questions {path!r} has no questions (one per line)")
    return questions


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


class ChatSession:
    """One prepared video and the answers given about it."""

    def __init__(self, pipe: Any, ctx: Any, tokenizer: Any, gen: dict[str, Any], seed: int | None):
        self.pipe, self.ctx, self.tokenizer, self.gen, self.seed = pipe, ctx, tokenizer, gen, seed
        self.conversation = pipe.conversation(ctx)
        self.answers: list[dict[str, Any]] = []
        self.prepare_seconds = 0.0

    def answer(self, question: str, *, history: bool) -> dict[str, Any]:
        """Stream the answer to `question` (after the earlier turns when `history`); errors are reported."""
        streamer = text_streamer(self.tokenizer)
        ask: Callable[..., Any] = (
            self.conversation.ask if history else (lambda q, **kw: self.pipe.ask(self.ctx, q, **kw))
        )
        t0 = time.perf_counter()
        try:
            out = ask(question, streamer=streamer, seed=self.seed, **self.gen)
        except HippoError as exc:
            message = one_line(exc)
            say(f"hippo: {message}")
            record = {"question": question, "error": message}
        else:
            s = out.stats
            new = out.sequences[0, out.sequences.shape[1] - s.new_tokens :].tolist()
            say(f"[{s.scheduler}] {s.summary()}")
            record = {
                "question": question,
                "text": self.tokenizer.decode(new, skip_special_tokens=True),
                "tokens": new,
                "seconds": time.perf_counter() - t0,
                "stats": s.as_dict(),
            }
        self.answers.append(record)
        return record

    def stats(self) -> str:
        done = [a for a in self.answers if "error" not in a]
        mem = self.ctx.memory()
        lines = [
            f"video prepared once in {self.prepare_seconds:.2f} s; context {_size(mem['total'])} "
            f"(KV {_size(mem['kv'])}, features {_size(mem['features'])})",
            f"questions answered: {len(done)} (errors: {len(self.answers) - len(done)}); "
            f"turns in this conversation: {len(self.conversation.turns)}",
        ]
        if done:
            tokens = sum(a["stats"]["new_tokens"] for a in done)
            seconds = sum(a["seconds"] for a in done)
            ttft = [a["stats"]["seconds_ttft"] for a in done]
            later = f", later ones median {statistics.median(ttft[1:]):.3f} s" if len(ttft) > 1 else ""
            lines.append(
                f"{tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s); time to first token: "
                f"first question {ttft[0]:.3f} s{later}"
            )
        return "\n".join(lines)

    def interact(self, read: Callable[[str], str] = input) -> None:
        """The read-answer loop: empty input re-prompts; /stats, /reset, /quit; end of input quits."""
        print(HELP, flush=True)
        while True:
            try:
                line = read("> ").strip()
            except (EOFError, KeyboardInterrupt):
                print(flush=True)
                return
            if not line:
                continue
            if line in ("/quit", "/exit"):
                return
            if line == "/stats":
                print(self.stats(), flush=True)
            elif line == "/reset":
                self.conversation.reset()
                print("(earlier turns forgotten; the video stays prepared)", flush=True)
            elif line.startswith("/"):
                print(f"unknown command {line!r}; {HELP}", flush=True)
            else:
                self.answer(line, history=True)


def cmd_chat(args: argparse.Namespace) -> int:
    cfg = pipeline_config(args)
    builder = PipelineBuilder.from_config(cfg)  # names and options are validated here
    gen = generation_kwargs(args)
    check_output(args.json, "--json")
    questions = read_questions(args.questions) if args.questions else None
    needs_draft = lookup("schedulers", cfg.scheduler.name).needs_draft
    progress = not args.no_progress
    with quiet_transformers(args.debug, progress):
        ready = prepare(args, cfg, needs_draft)
        bars = StageBars(disable=None if progress else True)
        try:
            pipe = builder.build()
            t0 = time.perf_counter()
            ctx = pipe.prepare(
                args.video,
                tokenizer=ready["tokenizer"],
                frames=args.frames,
                fps=args.fps,
                max_pixels=args.max_pixels,
                progress=bars,
            )
        finally:
            bars.close()
        session = ChatSession(pipe, ctx, ready["tokenizer"], gen, args.seed)
        session.prepare_seconds = time.perf_counter() - t0
        say(session.stats().splitlines()[0])
        if questions is None:
            if not sys.stdin.isatty():
                say("reading questions from standard input (one per line)")
            session.interact()
        else:
            for q in questions:
                print(f"Q: {q}", flush=True)
                session.answer(q, history=False)
        say(session.stats())
        memory = ctx.memory()
        pipe.close()
    if args.json:
        write_json(args.json, {"video": args.video, "memory": memory, "answers": session.answers})
    failed = any("error" in a for a in session.answers)
    if failed and questions is not None:
        raise InputError("some questions could not be answered (see the messages above)")
    return 0
