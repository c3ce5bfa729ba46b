"""Many prompts through one pipeline: the records `Pipeline.map` takes, the results it yields, and
how it batches them.

A record is one question about one video (a video file and a prompt, or processor inputs already
built) with its own generation settings. `Pipeline.map` reads `window` records ahead, builds their
inputs and sorts them by prompt length (visual tokens included, so mostly by video length), so that
rows decoded together pad little. Greedy rows are continuously batched on the pipeline's engine
when its schedule has a batched form (`hippo.engine`): up to `batch_size` rows live at once, a
finished row's place taken by the next at the next round. The others go one after another through
`Pipeline.generate`. Every answer is exactly what `generate` returns for that record alone.

A record that cannot be answered (a missing or bad field, a duplicate id, a missing or corrupt
video, a prompt longer than the context) yields a `Result` whose `error` is the one-line message the
CLI prints for the same `HippoError`, and the run goes on. Any other exception is a bug and
propagates.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from hippo.errors import ConfigError, HippoError, InputError, one_line
from hippo.sampling import resolve_generation_config
from hippo.types import Stats

#: a record's id: a string or an integer, compared as given ("1" and 1 are two ids)
RecordId = str | int

_INT, _NUMBER, _BOOL = "an integer", "a number", "true or false"
#: video options a record may set: (JSON type, valid, what is expected)
VIDEO_FIELDS: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "frames": (_INT, lambda v: v >= 1, ">= 1"),
    "fps": (_NUMBER, lambda v: 0 < v < math.inf, "> 0"),
    "max_pixels": (_INT, lambda v: v >= 1, ">= 1"),
}
#: generation settings a record may set (the ones `hippo generate` takes as flags)
GENERATION_FIELDS: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "max_new_tokens": (_INT, lambda v: v >= 1, ">= 1"),
    "do_sample": (_BOOL, lambda v: True, ""),
    "temperature": (_NUMBER, lambda v: 0 < v < math.inf, "> 0"),
    "top_p": (_NUMBER, lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (_INT, lambda v: v >= 1, ">= 1"),
    "seed": (_INT, lambda v: 0 <= v < 2**63, "in [0, 2**63)"),
}
RECORD_FIELDS = ("id", "video", "prompt", *VIDEO_FIELDS, *GENERATION_FIELDS)
_SAMPLING_ONLY = ("temperature", "top_p", "top_k")


def _is(kind: str, value: Any) -> bool:
    if kind == _BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind == _INT else isinstance(value, int | float)


def check_id(value: Any) -> RecordId:
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise InputError(f'a record needs an "id": a non-empty string or an integer, got {value!r}')
    return value


def check_fields(
    rid: RecordId, values: Mapping[str, Any], table: Mapping[str, tuple[str, Any, str]]
) -> dict[str, Any]:
    """The fields of `values` named in `table`, type- and range-checked (None: not set)."""
    out = {}
    for key, (kind, ok, rule) in table.items():
        value = values.get(key)
        if value is None:
            continue
        if not _is(kind, value) or not ok(value):
            expected = f"{kind} {rule}".strip()
            raise InputError(f'record {rid!r}: "{key}" must be {expected}, got {value!r}')
        out[key] = value
    return out


@attrs.frozen
class Record:
    """One question about one video: `video` (a file) and `prompt`, or processor `inputs`.

    `options` holds video options (frames, fps, max_pixels) and `generation` generation settings
    (`Pipeline.generate`'s keyword arguments, seed included); both override `Pipeline.map`'s.
    """

    id: RecordId
    video: str | os.PathLike | None = None
    prompt: str | None = None
    inputs: Mapping[str, Any] | None = None
    options: dict[str, Any] = attrs.field(factory=dict)
    generation: dict[str, Any] = attrs.field(factory=dict)

    @classmethod
    def from_dict(cls, d: Any) -> Record:
        """A record from a JSON object: `id`, `video`, `prompt`, then any of `RECORD_FIELDS`."""
        if not isinstance(d, Mapping):
            raise InputError(
                f"a record must be a JSON object with id, video and prompt, got {type(d).__name__}"
            )
        rid = check_id(d.get("id"))
        unknown = sorted(k for k in d if k not in RECORD_FIELDS)
        if unknown:
            raise InputError(
                f"record {rid!r}: unknown field(s) {', '.join(map(repr, unknown))}; a record takes "
                f"{', '.join(RECORD_FIELDS)}"
            )
        for key in ("video", "prompt"):
            if not isinstance(d.get(key), str) or not d[key].strip():
                raise InputError(f'record {rid!r}: "{key}" must be a non-empty string, got {d.get(key)!r}')
        return cls(
            rid,
            video=d["video"],
            prompt=d["prompt"],
            options=check_fields(rid, d, VIDEO_FIELDS),
            generation=check_fields(rid, d, GENERATION_FIELDS),
        )

    def check(self) -> Record:
        check_id(self.id)
        if (self.inputs is None) == (self.video is None):
            raise InputError(f"record {self.id!r}: give either video and prompt, or inputs")
        if self.video is not None and not isinstance(self.prompt, str):
            raise InputError(f"record {self.id!r}: a video needs a prompt (a string)")
        return self


@attrs.frozen
class Result:
    """The answer to one record: its new tokens (and their text when a tokenizer is known) and stats,
    or the one-line `error` that kept it from being answered."""

    id: RecordId | None
    token_ids: list[int] | None = None
    text: str | None = None
    prompt_tokens: int | None = None
    stats: Stats | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: {id, text, token_ids, prompt_tokens, stats} or {id, error}."""
        if self.error is not None:
            return {"id": self.id, "error": self.error}
        return {
            "id": self.id,
            "text": self.text,
            "token_ids": list(self.token_ids or []),
            "prompt_tokens": self.prompt_tokens,
            "stats": None if self.stats is None else self.stats.as_dict(),
        }


def failed(rid: RecordId | None, exc: BaseException) -> Result:
    return Result(rid, error=one_line(exc))


T = TypeVar("T")


def group_by_length(items: Sequence[T], length: Callable[[T], int], batch_size: int) -> list[list[T]]:
    """`items` sorted by `length` (stable) and cut into consecutive batches of up to `batch_size`."""
    ordered = sorted(items, key=length)
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


@attrs.define
class _Ready:
    """A record with its inputs built and its settings merged with the map's."""

    id: RecordId
    inputs: Mapping[str, Any]
    generation: dict[str, Any]

    @property
    def length(self) -> int:
        return int(self.inputs["input_ids"].shape[-1])


class _Tokenizer:
    """The tokenizer to build inputs and decode text: the one given, else the target checkpoint's,
    loaded once when first needed."""

    def __init__(self, pipe: Any, tokenizer: Any):
        self.pipe, self.value, self.error = pipe, tokenizer, None
        self.tried = tokenizer is not None

    def get(self, required: bool) -> Any:
        if not self.tried:
            self.tried = True
            try:
                self.value = self.pipe._checkpoint_tokenizer()
            except HippoError as exc:
                self.error = exc
        if self.value is None and required:
            raise self.error
        return self.value


def check_batching(batch_size: Any, window: Any, names: tuple[str, str] = ("batch_size", "window")) -> int:
    """The window (default 4 x `batch_size`) once both are valid; `names` are what the caller calls them."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"{names[0]} must be an integer >= 1, got {batch_size!r}")
    window = 4 * batch_size if window is None else window
    if isinstance(window, bool) or not isinstance(window, int) or window < batch_size:
        raise ConfigError(f"{names[1]} must be an integer >= {names[0]} ({batch_size}), got {window!r}")
    return window


def map_records(
    pipe: Any,
    records: Iterable[Record | Mapping[str, Any]],
    *,
    tokenizer: Any = None,
    batch_size: int = 4,
    window: int | None = None,
    options: Mapping[str, Any] | None = None,
    generation: Mapping[str, Any] | None = None,
) -> Iterator[Result]:
    """`Pipeline.map`: one Result per record, in the order they are decoded (each carries its id).
    Bad batching settings raise ConfigError here, before any record is read."""
    window = check_batching(batch_size, window)
    return _map(
        pipe, records, _Tokenizer(pipe, tokenizer), batch_size, window, options or {}, generation or {}
    )


def _map(
    pipe: Any,
    records: Iterable[Record | Mapping[str, Any]],
    tok: _Tokenizer,
    batch_size: int,
    window: int,
    options: Mapping[str, Any],
    generation: Mapping[str, Any],
) -> Iterator[Result]:
    seen: set[RecordId] = set()
    ready: list[_Ready] = []
    for item in records:
        got = _prepare(pipe, item, seen, tok, options, generation)
        if isinstance(got, Result):
            yield got
            continue
        ready.append(got)
        if len(ready) >= window:
            yield from _decode_window(pipe, ready, batch_size, tok)
            ready = []
    yield from _decode_window(pipe, ready, batch_size, tok)


def _prepare(
    pipe: Any,
    item: Record | Mapping[str, Any],
    seen: set[RecordId],
    tok: _Tokenizer,
    options: Mapping[str, Any],
    generation: Mapping[str, Any],
) -> _Ready | Result:
    rid = item.get("id") if isinstance(item, Mapping) else getattr(item, "id", None)
    rid = rid if isinstance(rid, str | int) and not isinstance(rid, bool) else None
    try:
        record = (item if isinstance(item, Record) else Record.from_dict(item)).check()
        if record.id in seen:
            raise InputError(f"record {record.id!r}: duplicate id; each id is answered once")
        seen.add(record.id)
        gen = {**generation, **record.generation}
        sampling = [k for k in _SAMPLING_ONLY if k in record.generation]
        if sampling and "do_sample" in gen and not gen["do_sample"]:
            raise InputError(
                f'record {record.id!r}: "{sampling[0]}" only applies when sampling, but "do_sample" is '
                'false; set "do_sample": true or remove it'
            )
        inputs = record.inputs
        if inputs is None:
            opts = dict(options)
            if "frames" in record.options or "fps" in record.options:
                opts.pop("frames", None), opts.pop("fps", None)
            opts.update(record.options)
            inputs = pipe.video_inputs(record.video, record.prompt, tokenizer=tok.get(required=True), **opts)
        pipe._check_inputs(inputs)  # what generate would refuse, before the window is sorted by length
        return _Ready(record.id, inputs, gen)
    except HippoError as exc:
        return failed(rid, exc)


def _decode_window(pipe: Any, ready: list[_Ready], batch_size: int, tok: _Tokenizer) -> Iterator[Result]:
    """The window's answers: greedy rows continuously batched (`decode_continuously`), shortest
    prompts first; the others one after another through `Pipeline.generate`."""
    tokenizer = tok.get(required=False)
    rows = sorted(ready, key=lambda r: r.length)
    together = _batchable(pipe, rows) if batch_size > 1 else []
    done: set[int] = set()
    if together:
        for row, result in decode_continuously(pipe, together, batch_size, tokenizer):
            done.add(id(row))
            yield result
    for row in rows:
        if id(row) not in done:
            yield _alone(pipe, row, tokenizer)


def decode_continuously(
    pipe: Any, rows: list[_Ready], batch_size: int, tokenizer: Any
) -> Iterator[tuple[_Ready, Result]]:
    """(row, its answer) as rows finish on one engine (`hippo.engine`) that keeps up to `batch_size`
    rows live: a finished row's place goes to the next at the next round boundary. A row whose
    prefill fails gets its error; when a round fails with a HippoError, the rows still live stop and
    are left to the caller (one by one through `generate`). Each answer is what `generate` returns
    for that row alone."""
    engine = pipe.engine()
    engine.expected_rows = min(batch_size, len(rows))
    try:
        queue = list(rows)
        live: dict[int, tuple[_Ready, Any]] = {}
        while queue or live:
            while queue and len(live) < batch_size:
                row = queue.pop(0)
                gen = dict(row.generation)
                seed = gen.pop("seed", None)
                try:
                    job = pipe.job(row.inputs, seed=seed, **gen)
                    joined = engine.add(job)
                except HippoError as exc:
                    yield row, failed(row.id, exc)
                    continue
                if joined:
                    live[id(job)] = (row, job)
                else:
                    yield row, _job_result(row, job, tokenizer)
            try:
                finished = engine.step()
            except HippoError:
                for _, job in live.values():
                    engine.cancel(job)
                return
            for job in finished:
                row, job = live.pop(id(job))
                if job.error is None:
                    yield row, _job_result(row, job, tokenizer)
                elif isinstance(job.error, HippoError):
                    yield row, failed(row.id, job.error)
                else:  # not a HippoError: a bug, which propagates
                    raise job.error
    finally:
        engine.close()


def _alone(pipe: Any, row: _Ready, tokenizer: Any) -> Result:
    gen = dict(row.generation)
    seed = gen.pop("seed", None)
    try:
        out = pipe.generate(row.inputs, seed=seed, **gen)
    except HippoError as exc:
        return failed(row.id, exc)
    return _result(row, out, tokenizer)


def _batchable(pipe: Any, batch: list[_Ready]) -> list[_Ready]:
    """The rows of `batch` to decode together: the greedy ones, when there are two or more and the
    pipeline's schedule has a batched form."""
    if len(batch) < 2 or not pipe.can_batch():
        return []
    rows = []
    for row in batch:
        gen = {k: v for k, v in row.generation.items() if k != "seed"}
        try:
            greedy = not resolve_generation_config(pipe.target, None, gen).do_sample
        except HippoError:
            greedy = False  # generate reports the error
        if greedy:
            rows.append(row)
    return rows if len(rows) >= 2 else []


def _job_result(row: _Ready, job: Any, tokenizer: Any) -> Result:
    new = list(job.tokens)
    text = None if tokenizer is None else tokenizer.decode(new, skip_special_tokens=True)
    return Result(row.id, token_ids=new, text=text, prompt_tokens=row.length, stats=job.stats)


def _result(row: _Ready, out: Any, tokenizer: Any) -> Result:
    new = out.sequences[0, row.length :].tolist()
    text = None if tokenizer is None else tokenizer.decode(new, skip_special_tokens=True)
    return Result(row.id, token_ids=new, text=text, prompt_tokens=row.length, stats=out.stats)
