"""`hippo batch IN.jsonl OUT.jsonl`: answer every record of a JSONL file, resumably.

IN holds one JSON object per line: `id`, `video`, `prompt`, and optionally `frames`, `fps`,
`max_pixels`, `max_new_tokens`, `do_sample`, `temperature`, `top_p`, `top_k`, `seed` (these override
the command-line options for that record). OUT gets one JSON line per record, as soon as it is
answered (written, flushed and fsync'd): `{id, text, token_ids, prompt_tokens, stats}`, or
`{id, line, error}` where `error` is the one-line message `hippo generate` prints for the same problem
and `line` the record's line in IN.

Resuming: a re-run skips every id that OUT answers, so a killed run loses at most the rows in flight
and answers none twice. Error lines are dropped from OUT and their records tried again (a missing
video may have been copied in since); a last line cut short by the kill is dropped too. OUT is then
rewritten once, atomically, before anything is appended.

Records go through `Pipeline.map` (in-process) or the same on Ray actors (`hippo.cli.batch_ray`);
either way this process reads IN and writes OUT. Exit status: 0 every record answered, 1 some
records failed (the summary line says how many), 2 bad usage (a missing IN, bad options or
checkpoints: nothing is decoded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

from hippo.builder import PipelineBuilder
from hippo.checkpoint import check_output
from hippo.cli.video_commands import generation_kwargs, pipeline_config, prepare, quiet_transformers, say
from hippo.errors import ConfigError, HippoError, one_line
from hippo.records import Record, check_batching, check_id
from hippo.registry import lookup

EXIT_FAILED = 1


# ---- OUT: what is answered already, and appending answers safely -----------------------------------


class Answers:
    """The output file: the ids it answers, and `write(entry)`, one line each, flushed and fsync'd."""

    def __init__(self, path: str | os.PathLike):
        check_output(path, "OUT")
        self.path = Path(path).expanduser()
        self.done: set[Any] = set()
        keep, changed = self._read()
        if changed:
            self._rewrite(keep)
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def _read(self) -> tuple[list[str], bool]:
        """The lines to keep (answers) and whether anything was dropped (errors, a cut-off last line)."""
        if not self.path.exists():
            return [], False
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read OUT {str(self.path)!r} to resume ({exc})") from None
        lines = text.split("\n")
        cut = lines.pop()  # "" when the file ends with a newline; else what a kill left mid-line
        keep, changed = [], bool(cut)
        for n, line in enumerate(lines, 1):
            if not line.strip():
                changed = True
                continue
            entry = _parse_answer(line)
            if entry is None:
                raise ConfigError(
                    f"OUT {str(self.path)!r} line {n} is not an answer hippo batch wrote; "
                    "resume with the OUT of an earlier run, or choose a new OUT"
                )
            if "error" in entry or entry["id"] in self.done:
                changed = True  # retried / a duplicate from an edited file: dropped
                continue
            self.done.add(entry["id"])
            keep.append(line)
        entry = _parse_answer(cut) if cut else None
        if entry is not None and "error" not in entry and entry["id"] not in self.done:
            self.done.add(entry["id"])  # the whole line made it, only its newline did not
            keep.append(cut)
        return keep, changed

    def _rewrite(self, lines: list[str]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.writelines(line + "\n" for line in lines)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(self.path.parent)

    def write(self, entry: dict[str, Any]) -> None:
        self.file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


def _parse_answer(line: str) -> dict[str, Any] | None:
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    if not isinstance(entry, dict) or "id" not in entry or not ("error" in entry or "token_ids" in entry):
        return None
    return entry


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not possible on every platform; the data itself is synced
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- IN: the records still to answer ----------------------------------------------------------------


@attrs.define
class Work:
    """IN read against OUT: the records to answer, the lines that are errors already, the line of each id."""

    records: list[dict[str, Any]] = attrs.Factory(list)
    errors: list[dict[str, Any]] = attrs.Factory(list)
    lines: dict[Any, int] = attrs.Factory(dict)
    skipped: int = 0


def read_work(path: str, done: set[Any]) -> Work:
    """Every non-blank line of IN: a record to answer, an error entry, or skipped (answered in OUT)."""
    try:
        raw = Path(path).expanduser().read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read IN {path!r}: {exc.strerror}") from None
    work = Work()
    for n, data in enumerate(raw, 1):
        if not data.strip():
            continue
        rid = None
        try:
            try:
                d = json.loads(data.decode("utf-8"))
            except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError
                raise ConfigError(f"line {n} of IN is not a JSON object ({exc})") from None
            if isinstance(d, dict) and "id" in d:
                rid = check_id(d["id"])
                if rid in work.lines:
                    raise ConfigError(
                        f"record {rid!r}: duplicate id (line {n}; first on line {work.lines[rid]}); "
                        "each id is answered once"
                    )
                work.lines[rid] = n
                if rid in done:
                    work.skipped += 1
                    continue
            Record.from_dict(d)  # every format error here, with its line; the video is read later
        except HippoError as exc:
            work.errors.append({"id": rid, "line": n, "error": one_line(exc)})
            continue
        work.records.append(d)
    return work


# ---- the command -----------------------------------------------------------------------------------


def cmd_batch(args: argparse.Namespace) -> int:
    if not Path(args.input).expanduser().is_file():
        raise ConfigError(f"IN {args.input!r} is not a file; pass a JSONL file with one record per line")
    if os.path.abspath(args.input) == os.path.abspath(args.output):
        raise ConfigError("IN and OUT are the same file; write the answers to another file")
    window = check_batching(args.batch_size, args.window, ("--batch-size", "--window"))
    cfg = pipeline_config(args)
    builder = PipelineBuilder.from_config(cfg)  # names and options are validated here
    gen = generation_kwargs(args)
    if args.seed is not None:
        gen["seed"] = args.seed
    map_kwargs = dict(
        batch_size=args.batch_size,
        window=window,
        **{k: getattr(args, k) for k in ("frames", "fps", "max_pixels") if getattr(args, k) is not None},
        **gen,
    )
    session: Any = contextlib.nullcontext()
    if args.ray is not None:
        from hippo.cli.batch_ray import check_ray_options, ray_session, run_on_ray

        check_ray_options(args)
        session = ray_session(args)
    needs_draft = lookup("schedulers", cfg.scheduler.name).needs_draft
    progress = not args.no_progress
    with quiet_transformers(args.debug, progress):
        ready = prepare(args, cfg, needs_draft)  # checkpoints and tokenizers, before any model loads
        with session as actors:  # connected to Ray (with --ray) before OUT is touched
            answers = Answers(args.output)
            try:
                work = read_work(args.input, answers.done)
                if args.ray is not None:
                    results = run_on_ray(args, cfg, work.records, map_kwargs, actors)
                else:
                    results = _in_process(builder, ready["tokenizer"], work.records, map_kwargs)
                counts = _write_all(answers, work, results, progress)
            finally:
                answers.close()
    failed = counts["failed"]
    say(
        f"hippo batch: {counts['answered']} answered, {failed} failed, {work.skipped} already in OUT; "
        f"{counts['tokens']} new tokens in {counts['seconds']:.1f} s "
        f"({counts['tokens'] / max(counts['seconds'], 1e-9):.1f} tok/s) -> {args.output}"
    )
    return EXIT_FAILED if failed else 0


def _in_process(
    builder: PipelineBuilder, tokenizer: Any, records: list[dict[str, Any]], map_kwargs: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    if not records:
        return
    pipe = builder.build()
    try:
        for result in pipe.map(records, tokenizer=tokenizer, **map_kwargs):
            yield result.as_dict()
    finally:
        pipe.close()


def _write_all(
    answers: Answers, work: Work, results: Iterable[dict[str, Any]], progress: bool
) -> dict[str, Any]:
    """Write the reader's errors, then each result as it comes; a tqdm bar with rows/s and tokens/s."""
    from tqdm.auto import tqdm

    counts = {"answered": 0, "failed": 0, "tokens": 0}
    t0 = time.perf_counter()
    with tqdm(
        total=len(work.errors) + len(work.records),
        unit="row",
        desc="hippo batch",
        file=sys.stderr,
        disable=None if progress else True,
        dynamic_ncols=True,
    ) as bar:

        def entries() -> Iterator[dict[str, Any]]:
            yield from work.errors
            for entry in results:
                if "error" in entry:
                    entry = {"id": entry["id"], "line": work.lines.get(entry["id"]), "error": entry["error"]}
                yield entry

        for entry in entries():
            answers.write(entry)
            if "error" in entry:
                counts["failed"] += 1
            else:
                counts["answered"] += 1
                counts["tokens"] += len(entry["token_ids"])
            bar.update(1)
            bar.set_postfix_str(f"{counts['tokens'] / max(time.perf_counter() - t0, 1e-9):.1f} tok/s")
    counts["seconds"] = time.perf_counter() - t0
    return counts
