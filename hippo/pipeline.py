"""The assembled pipeline: generation settings -> DecodeJob -> scheduler -> output."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from os import PathLike
from typing import Any

import attrs
import torch
from transformers import GenerationConfig

from hippo.context import Turn, VideoContext, check_budget, context_steps, estimate_bytes
from hippo.conversation import Conversation, Question, as_ids, text_question_ids
from hippo.engine import Engine, can_batch, row_sessions
from hippo.errors import ConfigError, InputError
from hippo.interfaces import Adapter, Drafter, Scheduler, Scorer, Selector, SessionKind, Verifier
from hippo.job import DecodeJob, Parts, stage
from hippo.padded import split_rows
from hippo.records import Record, Result, map_records
from hippo.registry import lookup, plugin_manager
from hippo.sampling import TokenPolicy, make_generator, resolve_generation_config
from hippo.types import GenerateOutput


@attrs.define(eq=False, slots=False)
class Pipeline:
    """A target, an optional draft, and the parts that decide what the draft sees and when it runs.

    `generate` returns exactly what `target.generate` returns for the same settings (greedy), or a
    sample from exactly the same distribution (sampling).
    """

    target_adapter: Adapter
    draft_adapter: Adapter | None
    scorer: Scorer | None
    selector: Selector
    drafter: Drafter
    verifier: Verifier | None  # None: greedy when decoding greedily, rejection when sampling
    scheduler: Scheduler
    names: dict[str, str] = attrs.field(factory=dict)  # part -> the name it was built under
    #: per role ("target", "draft"): what takes over its prefilled sessions: packed weights
    #: (`hippo.packed`) and/or a static cache, compiled (`hippo.static`); None: as prefilled
    sessions: dict[str, SessionKind | None] = attrs.field(factory=lambda: {"target": None, "draft": None})
    #: bytes all live video contexts may hold together (None: only the device's free memory limits)
    context_budget: int | None = None
    _closed: bool = attrs.field(default=False, init=False)
    _contexts: weakref.WeakSet = attrs.field(factory=weakref.WeakSet, init=False)
    _stock: dict = attrs.field(factory=dict, init=False)  # the default verifier of each mode, made once

    @property
    def target(self) -> torch.nn.Module:
        return self.target_adapter.model

    @property
    def draft(self) -> torch.nn.Module | None:
        return None if self.draft_adapter is None else self.draft_adapter.model

    def _verifier_for(self, do_sample: bool) -> Verifier:
        if self.verifier is None:  # one instance per mode, so a batch's rows share it (one decision)
            name = "rejection" if do_sample else "greedy"
            if name not in self._stock:
                self._stock[name] = lookup("verifiers", name)()
            return self._stock[name]
        if do_sample and self.verifier.greedy_only:
            raise ConfigError(
                f"verifier {self.names.get('verifier', '?')!r} is exact only for greedy decoding but "
                "do_sample=True; use .verifier('rejection') or leave the verifier unset"
            )
        return self.verifier

    def generate(
        self,
        inputs: dict[str, Any] | Sequence[dict[str, Any]],
        generation_config: GenerationConfig | None = None,
        *,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        streamer: Any = None,
        progress: Callable[[str, str], None] | None = None,
        timeline: bool = False,
        **generation_kwargs: Any,
    ) -> GenerateOutput | list[GenerateOutput]:
        """Decode one prompt. `inputs` is the processor's output (input_ids, pixel_values_videos, ...).

        `streamer` gets `put(prompt ids)`, `put(new ids)` as tokens are accepted, then `end()`, as in
        transformers. `progress(stage, "start" | "end")` is told when the long steps ("vision encoding",
        "target prefill", "draft prefill") start and end. `timeline=True` books every piece of
        work of both models on `stats.events` (`hippo.events`; drawn by `hippo.cli.timeline`).

        Several prompts, as a list of processor outputs or as one padded batch (input_ids [B, L] with
        its attention_mask), give a list with each row's own output: `generate_batch`'s where the
        schedule decodes rows together, else the rows' one after another. The keywords above are for
        one prompt; `generate_batch` takes one seed per row.
        """
        rows, several = self._rows(inputs)
        if several:
            given = dict(
                seed=seed, generator=generator, streamer=streamer, progress=progress, timeline=timeline
            )
            refused = [k for k, v in given.items() if v is not None and v is not False]
            if refused:
                raise InputError(
                    f"{', '.join(refused)} apply to one prompt but {len(rows)} were given; call generate "
                    "per row, or generate_batch(inputs, seeds=[...]) for one seed per row"
                )
            if self.can_batch():
                return self.generate_batch(rows, generation_config, **generation_kwargs)
            return [self.generate(x, generation_config, **generation_kwargs) for x in rows]
        inputs = rows[0]
        self._check_inputs(inputs)
        options = dict(
            seed=seed, generator=generator, streamer=streamer, progress=progress, timeline=timeline
        )
        return self._decode(inputs, None, generation_config, {**options, **generation_kwargs})

    def generate_batch(
        self,
        inputs: Sequence[dict[str, Any]] | dict[str, Any],
        generation_config: GenerationConfig | None = None,
        *,
        seeds: Sequence[int | None] | None = None,
        per_row: Sequence[dict[str, Any]] | None = None,
        **generation_kwargs: Any,
    ) -> list[GenerateOutput]:
        """Decode many prompts together (`hippo.engine`): one output per row, each with its own stats,
        each what `generate` returns for that row alone. `inputs`: one processor output per row (each
        of batch size 1), or one padded batch that the target's adapter cuts into rows
        (`Adapter.batch_items`); `seeds`: one per row; `per_row`: one dict of generation settings per
        row, over `generation_kwargs`. Runs every schedule with a batched form (`auto`, the default;
        `serial`; `pearl` and `hippo`, whose draft drafts each row's next block beside the target;
        `autoregressive`) with the `chain` drafter; others raise UnsupportedError (`generate` decodes
        their rows one after another)."""
        inputs = self._rows(inputs)[0]
        for x in inputs:
            self._check_inputs(x)
        engine = self.engine()  # refuses a schedule without a batched form
        n = len(inputs)
        rows = per_row if per_row is not None else [{}] * n
        seeds = seeds if seeds is not None else [None] * n
        if len(rows) != n or len(seeds) != n:
            raise InputError(f"{n} rows of inputs but {len(rows)} per_row settings and {len(seeds)} seeds")
        jobs = [
            self.job(x, generation_config, seed=seed, **{**generation_kwargs, **r})
            for x, r, seed in zip(inputs, rows, seeds)
        ]
        try:
            engine.run(jobs)
        finally:
            engine.close()
        return [_output(job, x) for job, x in zip(jobs, inputs)]

    def can_batch(self) -> bool:
        """Whether `generate_batch` can decode rows together with this pipeline's schedule."""
        return can_batch(self)

    def engine(self, sampled_gamma: int | None = None) -> Engine:
        """A batch engine on this pipeline (`hippo.engine`): `add` jobs from `job`, `step`, `cancel`."""
        return Engine(self, sampled_gamma)

    def job(
        self,
        inputs: dict[str, Any] | None = None,
        generation_config: GenerationConfig | None = None,
        *,
        turn: Turn | None = None,
        seed: int | None = None,
        streamer: Any = None,
        **generation_kwargs: Any,
    ) -> DecodeJob:
        """A job for the batch engine: `inputs` (one prompt) or `turn` (a question on a prepared video,
        `hippo.context.Turn`), decoded as `generate` decodes it, with sessions the engine stacks."""
        if turn is not None:
            inputs = turn.inputs
        self._check_inputs(inputs)
        parts = attrs.evolve(self, sessions=row_sessions(self))
        return self._job(
            inputs,
            generation_config,
            generation_kwargs,
            parts=parts,
            seed=seed,
            streamer=streamer,
            source=turn,
        )

    def _rows(self, inputs: Any) -> tuple[list[dict[str, Any]], bool]:
        """(the prompts' rows, whether several were given: a list, or a padded batch of B > 1). A
        padded batch is cut by the target's adapter; one unpadded prompt passes through as it is."""
        if isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)):
            if not inputs:
                raise InputError("no inputs: give one processor output, or a non-empty list of them")
            return [row for x in inputs for row in self._rows(x)[0]], True
        if not isinstance(inputs, Mapping):
            return [inputs], False  # _check_inputs names what is wrong
        ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] == 0:
            return [inputs], False
        if ids.shape[0] == 1 and (mask is None or bool(mask.all())):
            return [inputs], False
        rows = split_rows(inputs, self.target_adapter.batch_items(inputs))
        return rows, len(rows) > 1

    def _check_inputs(self, inputs: dict[str, Any]) -> None:
        if self._closed:
            raise InputError("this pipeline is closed; build a new one")
        if not hasattr(inputs, "get") or inputs.get("input_ids") is None:
            raise InputError("inputs must be the mapping a Hugging Face processor returns, with input_ids")
        ids = inputs["input_ids"]
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise InputError(
                f"input_ids must be [1, L] (one prompt), got {tuple(ids.shape)}; generate and "
                "generate_batch take several prompts (a list, or a padded batch)"
            )
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise InputError(
                "attention_mask has padding; pass the prompt's own tokens (generate cuts a padded "
                "batch into its rows)"
            )

    def _decode(
        self,
        inputs: dict[str, Any],
        turn: Turn | None,
        generation_config: GenerationConfig | None,
        kwargs: dict,
    ) -> GenerateOutput:
        """One prompt through a DecodeJob and the scheduler (`turn`: from a video context's cache).

        `kwargs`: `generate`'s keywords (seed, generator, streamer, progress, timeline) and settings."""
        if turn is None:  # a whole prompt: refused before any work if its cache cannot fit
            L = int(inputs["input_ids"].shape[-1])
            check_budget(self, estimate_bytes(self.target_adapter, L), L, kind="a prompt")
        generation_kwargs = dict(kwargs)
        keywords = ("seed", "generator", "streamer", "progress", "timeline")
        options = {k: generation_kwargs.pop(k) for k in keywords if k in generation_kwargs}
        job = self._job(inputs, generation_config, generation_kwargs, source=turn, **options)
        try:
            self.scheduler.decode(job)
        finally:
            job.finish()
        return _output(job, inputs)

    def _job(
        self,
        inputs: dict[str, Any],
        generation_config: GenerationConfig | None,
        generation_kwargs: dict[str, Any],
        *,
        parts: Parts | None = None,  # None: this pipeline's
        seed: int | None = None,
        generator: torch.Generator | None = None,
        streamer: Any = None,
        progress: Callable[[str, str], None] | None = None,
        timeline: bool = False,
        source: Turn | None = None,  # None: the prompt of `inputs`
    ) -> DecodeJob:
        """The job that decodes `inputs` with these settings (`generate`'s keywords)."""
        prompt, gc, max_new, eos = self._settings(inputs, generation_config, generation_kwargs)
        policy = TokenPolicy.for_model(self.target, gc, prompt, make_generator(seed, generator))
        if streamer is not None:
            streamer.put(prompt)
        job = DecodeJob(
            self if parts is None else parts,
            inputs,
            prompt,
            policy,
            self._verifier_for(gc.do_sample),
            max_new,
            eos,
            streamer,
            progress,
            record_events=timeline,
            source=source,
        )
        job.stats.scheduler = self.names.get("scheduler", type(self.scheduler).__name__)
        return job

    def _settings(
        self,
        inputs: dict[str, Any],
        generation_config: GenerationConfig | None,
        generation_kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, GenerationConfig, int, list[int]]:
        """The prompt [L], the resolved generation config, the token budget and the EOS ids."""
        prompt = inputs["input_ids"][0].cpu()
        L = prompt.shape[0]
        ctx = self.target_adapter.context_length()
        if L >= ctx:
            raise InputError(
                f"the prompt has {L} tokens but the target's context is {ctx}; use fewer frames or a "
                "lower resolution (max_pixels)"
            )
        gc = resolve_generation_config(self.target, generation_config, generation_kwargs)
        max_new = gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length - L
        eos = gc.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return prompt, gc, max_new, eos

    def generate_from_video(self, path: str | PathLike, prompt: str, **kwargs: Any) -> GenerateOutput:
        """Decode an answer to `prompt` about the video file at `path`.

        `video_inputs(path, prompt, ...)` with its options among `kwargs` (tokenizer, frames, fps,
        max_pixels, progress), then `generate(inputs, ...)` with the rest. Decode the answer with
        `tokenizer.decode(out.sequences[0, prompt_length:])`.
        """
        video = {k: kwargs.pop(k) for k in ("tokenizer", "frames", "fps", "max_pixels") if k in kwargs}
        progress = kwargs.pop("progress", None)
        inputs = self.video_inputs(path, prompt, progress=progress, **video)
        return self.generate(inputs, progress=progress, **kwargs)

    def video_inputs(
        self,
        path: str | PathLike,
        prompt: str,
        *,
        tokenizer: Any = None,
        frames: int | None = None,
        fps: float | None = None,
        max_pixels: int | None = None,
        progress: Callable[..., None] | None = None,
    ) -> dict[str, Any]:
        """The target's inputs for `prompt` about the video file at `path`.

        Samples `frames` evenly spaced frames or `fps` per second (default 2 fps), and builds the
        inputs with `tokenizer` (default: the one saved with the target checkpoint) and its chat
        template, with at most `max_pixels` per frame.
        """
        options = dict(tokenizer=tokenizer, frames=frames, fps=fps, max_pixels=max_pixels, progress=progress)
        inputs = plugin_manager().hook.hippo_video_inputs(
            pipeline=self, path=path, prompt=prompt, options=options
        )
        if inputs is None:
            raise ConfigError(
                "no installed plugin reads video files (hippo_video_inputs); install hippo with its "
                "hippo.media package, or build the inputs with your model's processor and call generate"
            )
        return inputs

    def map(
        self,
        records: Iterable[Record | Mapping[str, Any]],
        *,
        tokenizer: Any = None,
        batch_size: int = 4,
        window: int | None = None,
        frames: int | None = None,
        fps: float | None = None,
        max_pixels: int | None = None,
        **generation_kwargs: Any,
    ) -> Iterator[Result]:
        """Answer many records, one `Result` per record, in the order they are decoded (each has its id).

        A record is a `hippo.records.Record` or a mapping like one line of `hippo batch`'s input:
        `{"id", "video", "prompt"}` plus optional `frames`, `fps`, `max_pixels`, `max_new_tokens`,
        `do_sample`, `temperature`, `top_p`, `top_k`, `seed`, which override the arguments given
        here. `window` records (default 4 x `batch_size`) are read ahead, their inputs built and
        sorted by prompt length (visual tokens included). Greedy rows are continuously batched when
        the schedule has a batched form (`hippo.engine`: up to `batch_size` rows live, a finished
        row's place taken by the next), the others decoded one after another; each exactly as
        `generate` decodes it alone. A record that cannot be answered yields a Result with `error`, the
        one-line message of its HippoError, and the others go on. `tokenizer` (default: the target
        checkpoint's) builds the inputs of video records and decodes `Result.text`.
        """
        options = {"frames": frames, "fps": fps, "max_pixels": max_pixels}
        return map_records(
            self,
            records,
            tokenizer=tokenizer,
            batch_size=batch_size,
            window=window,
            options={k: v for k, v in options.items() if v is not None},
            generation=generation_kwargs,
        )

    # ---- video contexts: encode a video once, answer many questions ---------------------------------
    def prepare(
        self,
        source: dict[str, Any] | str | PathLike,
        *,
        tokenizer: Any = None,
        frames: int | None = None,
        fps: float | None = None,
        max_pixels: int | None = None,
        progress: Callable[..., None] | None = None,
        prefill_rows: int | None = None,
    ) -> VideoContext:
        """Encode a video and prefill its shared prefix once, for `ask` and `conversation`.

        `source` is processor inputs of a prompt holding the video (everything after the video's
        last placeholder token is dropped: ask with the question's token ids), or a video file
        (`video_inputs` options; text questions then use `tokenizer`, default the checkpoint's).
        `prefill_rows`: the target's prefill runs in pieces of at most this many prompt rows, so its
        activations are those of one piece, not of the whole prompt (the context is the same).
        Raises MemoryBudgetError when the context would exceed `context_budget` or free memory.
        """
        options = dict(tokenizer=tokenizer, frames=frames, fps=fps, max_pixels=max_pixels, progress=progress)
        *_, ctx = self.prepare_steps(source, prefill_rows=prefill_rows, **options)  # back to back
        return ctx

    def prepare_steps(
        self,
        source: dict[str, Any] | str | PathLike,
        *,
        prefill_rows: int | None = None,
        tokenizer: Any = None,
        frames: int | None = None,
        fps: float | None = None,
        max_pixels: int | None = None,
        progress: Callable[..., None] | None = None,
    ) -> Iterator[VideoContext | None]:
        """`prepare` in steps, for a caller that runs other work on the models between them (decoding
        other requests): with `prefill_rows`, yields None after reading the video, after encoding it
        and after each piece of at most `prefill_rows` prompt rows of the target's prefill but the
        last, then the context (equal to `prepare`'s); with None, yields the context alone, in one
        step. Close the generator to abandon the context."""
        if prefill_rows is not None and (type(prefill_rows) is not int or prefill_rows < 1):
            raise ConfigError(
                f"prefill_rows must be a positive int (rows per prefill piece) or None, got {prefill_rows!r}"
            )
        video = dict(tokenizer=tokenizer, frames=frames, fps=fps, max_pixels=max_pixels, progress=progress)
        return self._prepare_steps(source, prefill_rows, **video)

    def _prepare_steps(
        self, source: Any, prefill_rows: int | None, *, tokenizer: Any, progress: Any, **video: Any
    ) -> Iterator[VideoContext | None]:
        if isinstance(source, str | PathLike):
            if tokenizer is None:
                tokenizer = self._checkpoint_tokenizer()
            source = self.video_inputs(
                source,
                "?",  # cut off: only the prefix up to the end of the video is kept
                tokenizer=tokenizer,
                progress=progress,
                **video,
            )
            if prefill_rows is not None:
                yield None
        self._check_inputs(source)
        stage = self._stage(progress)
        for ctx in context_steps(self, source, tokenizer=tokenizer, stage=stage, prefill_rows=prefill_rows):
            if ctx is None:
                yield None
        self._contexts.add(ctx)
        yield ctx

    def ask(self, ctx: VideoContext, question: Question, **generation_kwargs: Any) -> GenerateOutput:
        """Answer one question about a prepared video; returns what `generate` returns on the whole
        prompt (the cached prefix + the question). `question`: text (chat template, one user turn)
        or token ids (appended after the prefix). The context is left unchanged."""
        if isinstance(question, str):
            return self.ask_ids(ctx, text_question_ids(ctx, [(question, None)]), **generation_kwargs)
        return self.ask_ids(ctx, as_ids(question), **generation_kwargs)

    def ask_ids(
        self,
        ctx: VideoContext,
        question: Sequence[int] | torch.Tensor,  # [k] token ids after the prefix
        generation_config: GenerationConfig | None = None,
        **kwargs: Any,
    ) -> GenerateOutput:
        """`ask` with the exact tokens that follow the cached prefix (`kwargs` as `generate`'s)."""
        if ctx.pipeline is not self:
            raise InputError("this video context was prepared by another pipeline; prepare it with this one")
        turn = Turn(ctx, as_ids(question))
        self._check_inputs(turn.inputs)
        return self._decode(turn.inputs, turn, generation_config, kwargs)

    def conversation(self, ctx: VideoContext) -> Conversation:
        """A multi-turn conversation about a prepared video (each answer sees the earlier turns)."""
        return Conversation(self, ctx)

    def _stage(self, progress: Callable[..., None] | None) -> Callable[[str], Any]:
        return functools.partial(stage, progress)

    def _checkpoint_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        path = getattr(self.target.config, "_name_or_path", "") or ""
        try:
            return AutoTokenizer.from_pretrained(path)
        except Exception as exc:
            raise InputError(
                f"no tokenizer could be loaded from the target's checkpoint {path!r} ({exc}); pass tokenizer="
            ) from exc

    def close(self) -> None:
        """Release the models and any workers; the pipeline cannot generate afterwards."""
        if not self._closed:
            self.scheduler.close()
            for ctx in list(self._contexts):
                ctx.close()
        self._closed = True
        self.target_adapter = self.draft_adapter = None

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _output(job: DecodeJob, inputs: dict[str, Any]) -> GenerateOutput:
    """What `generate` returns for a finished job: the sequence on the inputs' device, stats, kept tokens."""
    sequences = job.prefix()[None].to(inputs["input_ids"].device)  # [1, T]
    return GenerateOutput(sequences=sequences, stats=job.stats, kept_visual_index=job.kept)
