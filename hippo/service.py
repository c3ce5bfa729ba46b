"""Many users at once on one pipeline: requests queue, join the batch engine between rounds, stream
their tokens back and leave when done or cancelled. `hippo serve` puts HTTP in front of it.

One thread (the loop) owns the models: it admits queued requests while the batch has room
(`max_batch`), prefills each on the pipeline's video context for its video, steps the engine
(`hippo.engine.Engine`) one round at a time, and delivers every row's new tokens to its `Ticket`.
A new video's preparation (read, encoded and prefilled once: the long prefill) is interleaved with
the rounds: the file is read and laid out on a media thread while the rounds go on (no model runs
there), then, while rows are live, the preparation advances by steps between two rounds (the
encoding, pieces of at most `prefill_rows` prompt rows of the target's prefill,
`Pipeline.prepare_steps`) until `prefill_seconds` of them have run (at least one step), so the live
rows wait for that and one piece at most, not for the whole prefill; with no live row, nobody
waits, and it runs to the end at once, its prefill in one piece (as do the others of a burst of new
videos that came together: the first one's rows wait for them once, after their first token).
A request starts in two halves (`Engine.admit`: the target's prefill of its question and its first
token; `Engine.join`: the draft's prefill, and the row joins the batch): the requests started in one
pass between two rounds are all admitted before any joins, so no first token waits for another
request's draft. At most `prepares_per_round` videos are in preparation while rows are live (default
1); requests about a prepared video (a question's few tokens) are admitted as the batch has room,
and those about a video in preparation start when it is ready. A queued request's new video is
read on the media thread as soon as it comes (`READ_AHEAD` at a time), while the loop is busy and
while the request waits for its turn, so its preparation starts on a file already read. `prefills_per_round` caps all
admissions per round while rows are live (default: none).
`stall_seconds` records each step the live rows waited for (the last `STALLS_KEPT`).
Other threads only submit, cancel and read tickets.

- **Video prefix cache.** A request names a video file and frame options; the first request about a
  (file content, frames, fps, max_pixels) prepares its context (`Pipeline.prepare`: the video
  encoded and prefilled once) and later ones extend it by their question's tokens (`Turn`). The
  cache is bounded in bytes (`VideoContext.memory`), least recently used first out. A row keeps its
  own fork of the cached prefix, so evicting a context never touches a live row.
- **Overload.** At most `max_queue` requests wait; `submit` raises `Overloaded` past that. A
  context that cannot fit even after the cache is emptied fails its request with the budget error.
- **Failures.** A request that cannot be answered (its video, its prompt, its settings, its own
  sampling or logits processing in a round) fails alone and the others go on. An error in a batched
  forward fails the rows of that round (their state is unknown); the loop goes on with the requests
  that come next.
- **Stopping.** `close(drain)` stops admitting (requests queued or waiting for their video's
  preparation fail), lets the live rows finish for up to `drain` seconds, then cancels what is
  left; every ticket ends.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch

from hippo.context import Turn
from hippo.conversation import Prompt, text_question_ids
from hippo.errors import HippoError, InputError, MemoryBudgetError, one_line

#: video options that make two requests about one file need two contexts
VIDEO_OPTIONS = ("frames", "fps", "max_pixels")

#: prompt rows per piece of a new video's prefill while rows are live (`Service(prefill_rows=)`)
PREFILL_ROWS = 256

#: while rows are live, a new video's preparation takes steps between two rounds until this many
#: seconds of them have run (at least one step; `Service(prefill_seconds=)`; 0: one step a round)
PREFILL_SECONDS = 0.1

#: new videos whose files are read ahead on the media thread while `prepares_per_round` keeps their
#: requests queued (their preparation's model steps wait; the reading does not need the models)
READ_AHEAD = 1

#: seconds the first rows of videos that came together to an idle service wait for the next one's
#: file to be read, when it was not read while the first ones were prepared (then its preparation
#: takes its steps between rounds)
BURST_READ_WAIT = 1.0

#: `Service.stall_seconds` keeps this many of the latest waits (a server runs for days)
STALLS_KEPT = 10_000

#: content hashes of video files kept (`ContextCache.digest`)
DIGESTS_KEPT = 4096

#: the share of the free host memory a video's decoded frames may take (`bound_video`)
FRAME_MEMORY_SHARE = 0.5


class Overloaded(HippoError):
    """The queue is full: retry later."""


@attrs.define
class Request:
    """One question about one video: `turns` are (user text, assistant answer or None) pairs, the
    last one unanswered (the first is asked with the video), as `hippo.conversation.messages`."""

    video: str
    turns: Sequence[tuple[str, str | None]]
    video_options: dict[str, Any] = attrs.field(factory=dict)  # frames, fps, max_pixels
    generation: dict[str, Any] = attrs.field(factory=dict)  # max_new_tokens, do_sample, ..., seed
    stop: Sequence[str] = ()  # stop strings: the answer ends before the first one
    system: str | None = None  # the system turn, before the video (part of the video context's key)
    logprobs: int | None = None  # None: no log-probabilities; k: each token's and its top k


class Ticket:
    """A submitted request: its events, in order, through `notify` (default: `events`, a queue).

    Events: ("started", {"prompt_tokens"}) once admitted; ("delta", text, token ids, log-probs) as
    tokens are accepted (log-probs: (token, `DecodeJob.token_logprobs` entry) of each token since
    the last delta, [] unless asked for);
    then ("end", info) or ("error", HippoError). `info`: finish_reason ("stop" or "length"),
    prompt_tokens, completion_tokens, the answer's text and token ids, and the job's stats.
    """

    def __init__(self, request: Request, tokenizer: Any, notify: Callable[[tuple], None] | None = None):
        self.request, self.tokenizer = request, tokenizer
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.notify = notify or self.events.put
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.job: Any = None
        self.key: tuple | None = None  # its video context's key (`ContextCache.key`), once the loop reads it
        self.key_error: HippoError | None = None  # why the key could not be read (the request fails)
        self.tokens: list[int] = []
        self.logprobs: list[Any] = []  # the job's token_logprobs of `tokens`, when asked for
        self._sent = 0  # tokens (and their log-probs) already delivered
        self.text = ""
        self._text = _Detokenizer(tokenizer)
        self.stopped = False  # a stop string was reached: the loop cancels the row
        self.ended = False
        self._prompt = True

    def cancel(self) -> None:
        """Stop decoding this request (its row leaves within one round)."""
        self.cancelled.set()

    # the job's streamer (`DecodeJob`): put(prompt ids), put(new ids) ..., end()
    def put(self, ids: Any) -> None:
        if self._prompt:
            self._prompt = False
            return
        if self.stopped or self.ended:
            return
        new = [int(x) for x in ids.reshape(-1).tolist()]
        self.tokens += new
        if self.job is not None and self.request.logprobs is not None:
            self.logprobs += self.job.token_logprobs[len(self.logprobs) : len(self.tokens)]
        delta = self._text.step(self.tokens)
        if delta is None:  # half a character: wait for the rest
            return
        text = self.text + delta  # a copy, not a decode: O(L) bytes, no tokenizer call
        cut = _first_stop(text, self.request.stop, len(self.text))
        if cut is not None:
            text, self.stopped = text[:cut], True
        delta, self.text = text[len(self.text) :], text
        if delta or new:
            lps = list(zip(self.tokens[self._sent :], self.logprobs[self._sent :]))
            self._sent = len(self.tokens)
            self.notify(("delta", delta, new, lps))

    def end(self) -> None:
        pass  # the loop ends the ticket once the job's stats are final

    def finish(self, info: dict[str, Any]) -> None:
        if not self.ended:
            self.ended = True
            self.notify(("end", info))
        self.job = None  # the job streams to this ticket: drop the cycle, and with it the job's caches

    def fail(self, error: BaseException) -> None:
        if not self.ended:
            self.ended = True
            self.notify(("error", error))
        self.job = None


class _Detokenizer:
    """The text a growing answer adds, decoding only its tail, as vLLM's incremental detokenizer does.

    Decoding the whole answer at every round costs O(L) a round, O(L²) an answer. Here each step
    decodes the tokens since the last text delivered plus a few tokens before them (`CONTEXT`, not
    counting special tokens, which decode to nothing) and returns what the new tokens add to the
    text of the context alone. The context carries what the text at a boundary depends on: the
    space a word-level or SentencePiece decoder puts (or strips) before a word, the clean-up of
    spaces before punctuation, and the bytes of a character that byte-level BPE splits over
    tokens. The deltas are the ones a full decode per step gives, wherever that decode does not
    rewrite text already sent (WordPiece's clean-up can: no stream takes text back);
    `tests/test_detokenizer.py` checks them on word-level, byte-level BPE, SentencePiece-style and
    WordPiece tokenizers.
    """

    CONTEXT = 4

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self.start = 0  # the window's first token: CONTEXT non-special tokens before `read`
        self.read = 0  # tokens whose text is delivered

    def step(self, ids: Sequence[int]) -> str | None:
        """What `ids` (the whole answer so far) adds to the text delivered; None while the text
        ends in half a character (the next tokens complete it)."""
        decode = self.tokenizer.decode
        text = decode(ids[self.start :], skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return None
        known = decode(ids[self.start : self.read], skip_special_tokens=True)
        self.read, self.start = len(ids), self._window(ids)
        return text[len(known) :]

    def _window(self, ids: Sequence[int]) -> int:
        """The start of the next window: CONTEXT non-special tokens before the end of `ids`."""
        need, i = self.CONTEXT, len(ids)
        while i > 0 and need:
            i -= 1
            need -= ids[i] not in self.special
        return i


def _first_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Where the first stop string begins in `text` (searching from a little before `start`)."""
    found = [i for s in stops if s and (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(found) if found else None


@attrs.define
class _Preparation:
    """A video's context being prepared, and the requests about it: the file read on the media thread
    (`reading`), then the steps of its encoding and prefill (`ContextCache.prepare`)."""

    reading: concurrent.futures.Future
    steps: Iterator[Any] | None = None
    tickets: list[Ticket] = attrs.Factory(list)


class ContextCache:
    """Prepared video contexts by (file content, video options), bounded in bytes, LRU."""

    def __init__(self, pipeline: Any, tokenizer: Any, max_bytes: int):
        self.pipeline, self.tokenizer, self.max_bytes = pipeline, tokenizer, max_bytes
        self.entries: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self.hits = self.misses = 0
        #: content hashes by (path, size, mtime): a file is hashed once, not on every request
        self.digests: collections.OrderedDict[tuple, str] = collections.OrderedDict()
        self.hashed = 0  # files read to hash them
        self.lock = threading.Lock()  # the loop and the media thread (`Service._read_ahead`) read keys

    def key(self, path: str, options: dict[str, Any], system: str | None = None) -> tuple:
        """The context's key: the file's content hash, the video options and the system turn (which
        comes before the video in the prompt) (InputError: unreadable)."""
        return (self.digest(path), *(options.get(k) for k in VIDEO_OPTIONS), system)

    def digest(self, path: str) -> str:
        """The file's content hash, cached by (path, size, mtime): a changed file is hashed again."""
        try:
            st = os.stat(path)
        except (OSError, ValueError) as exc:
            raise InputError(
                f"cannot read the video {path!r} ({getattr(exc, 'strerror', None) or exc})"
            ) from None
        stamp = (path, st.st_size, st.st_mtime_ns)
        with self.lock:
            found = self.digests.get(stamp)
        if found is None:
            found = _digest(path)
            with self.lock:
                self.digests[stamp] = found
                self.hashed += 1
                while len(self.digests) > DIGESTS_KEPT:
                    self.digests.popitem(last=False)
        with self.lock:
            self.digests.move_to_end(stamp)
        return found

    def read(self, path: str, options: dict[str, Any], system: str | None = None) -> dict[str, Any]:
        """The processor inputs of the video file for a context (its prefix: the question is cut
        off), after the system turn; the options are bounded first (`bound_video`)."""
        bound_video(self.pipeline, path, options)
        prompt = Prompt("?", system) if system else "?"
        return self.pipeline.video_inputs(path, prompt, tokenizer=self.tokenizer, **options)

    def holds(self, key: tuple) -> bool:
        ctx = self.entries.get(key)
        return ctx is not None and not ctx.closed

    @property
    def nbytes(self) -> int:
        return sum(ctx.nbytes for ctx in self.entries.values())

    def get(
        self, path: str, options: dict[str, Any], key: tuple | None = None, system: str | None = None
    ) -> Any:
        """The context for (path, options, system), prepared now if the cache does not hold it."""
        key = self.key(path, options, system) if key is None else key
        ctx = self.entries.get(key)
        if ctx is not None and not ctx.closed:
            self.hits += 1
            self.entries.move_to_end(key)
            return ctx
        *_, ctx = self.prepare(self.read(path, options, system), key)
        return ctx

    def prepare(
        self, source: Any, key: tuple, prefill_rows: int | None = None, **options: Any
    ) -> Iterator[Any]:
        """Prepare the context for `key` from `source` (a video file and its `options`, or its processor
        inputs) in steps (`Pipeline.prepare_steps`): yields None between two steps, then the context,
        cached. A context that would pass the pipeline's budget evicts the least recently used ones
        first (and the steps start again)."""
        self.misses += 1
        while True:
            try:
                for ctx in self.pipeline.prepare_steps(
                    source, prefill_rows=prefill_rows, tokenizer=self.tokenizer, **options
                ):
                    if ctx is None:
                        yield None
                break
            except MemoryBudgetError:
                if not self.entries:
                    raise
                self._evict()
        self.entries[key] = ctx
        while len(self.entries) > 1 and self.nbytes > self.max_bytes:
            self._evict()
        yield ctx

    def _evict(self) -> None:
        _, ctx = self.entries.popitem(last=False)
        ctx.close()

    def clear(self) -> None:
        while self.entries:
            self._evict()


def _digest(path: str) -> str:
    """The file's content hash (the same bytes under another name share a context)."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise InputError(f"cannot read the video {path!r} ({exc.strerror or exc})") from None


class Service:
    """The loop thread and its queue (see the module doc). `submit` a `Request`, read its `Ticket`."""

    def __init__(
        self,
        pipeline: Any,
        tokenizer: Any,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        cache_bytes: int = 4 << 30,
        prefills_per_round: int | None = None,  # while rows are live (None: as many as fit)
        prepares_per_round: int | None = 1,  # new videos in preparation while rows are live (None: all)
        prefill_rows: int | None = PREFILL_ROWS,  # rows per prefill piece while rows are live (None: whole)
        prefill_seconds: float = PREFILL_SECONDS,  # a preparation's steps between two rounds, in seconds
        on_round: Callable[[Service], None] | None = None,  # told after each round (metrics)
    ):
        if max_batch < 1 or max_queue < 0:
            raise InputError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        if prefill_rows is not None and (type(prefill_rows) is not int or prefill_rows < 1):
            raise InputError(f"prefill_rows must be a positive int or None, got {prefill_rows!r}")
        if not 0 <= prefill_seconds < math.inf:
            raise InputError(f"prefill_seconds must be a number of seconds >= 0, got {prefill_seconds!r}")
        self.pipeline, self.tokenizer = pipeline, tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefills_per_round = prefills_per_round
        self.prepares_per_round = prepares_per_round
        self.prefill_rows = prefill_rows
        self.prefill_seconds = prefill_seconds
        self.preparing: dict[tuple, _Preparation] = {}  # videos being prepared, by context key
        self.read_ahead: dict[tuple, concurrent.futures.Future] = {}  # queued new videos' readings
        self.reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hippo-media")
        self.contexts = ContextCache(pipeline, tokenizer, cache_bytes)
        self.engine = pipeline.engine()
        self.on_round = on_round
        self.pending: collections.deque[Ticket] = collections.deque()
        self.live: dict[int, Ticket] = {}  # id(job) -> ticket
        #: first token sent, joining the batch at the end of this pass: (ticket, seconds of its
        #: admission, whether rows waited for it)
        self.admitted: list[tuple[Ticket, float, bool]] = []
        self.cv = threading.Condition()
        self.accepting = True
        self._drain_until: float | None = None
        self.rounds = 0
        # each step of work between two rounds that live rows waited for (the last STALLS_KEPT)
        self.stall_seconds: collections.deque[float] = collections.deque(maxlen=STALLS_KEPT)
        self.thread = threading.Thread(target=self._loop, name="hippo-engine", daemon=True)
        self.thread.start()

    # ---- other threads ----------------------------------------------------------------------------
    def submit(self, request: Request, notify: Callable[[tuple], None] | None = None) -> Ticket:
        """Queue a request; raises Overloaded when `max_queue` requests already wait, InputError when
        the service is stopping."""
        ticket = Ticket(request, self.tokenizer, notify)
        with self.cv:
            if not self.accepting:
                raise InputError("the server is shutting down; send the request to another replica")
            if len(self.pending) >= self.max_queue:
                raise Overloaded(f"{len(self.pending)} requests are queued (--max-queue); retry shortly")
            self.pending.append(ticket)
            self.cv.notify()
        try:
            self.reader.submit(self._read_ahead)  # its file may be read while the loop is busy
        except RuntimeError:  # the service closed meanwhile: the loop fails the ticket
            pass
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        ticket.cancel()
        with self.cv:
            self.cv.notify()

    @property
    def queue_depth(self) -> int:
        return len(self.pending)

    @property
    def batch_size(self) -> int:
        return len(self.live)

    def close(self, drain: float = 30.0) -> None:
        """Stop admitting; the live rows get up to `drain` seconds to finish, then are cancelled."""
        with self.cv:
            self.accepting = False
            self._drain_until = time.perf_counter() + drain
            for ticket in self.pending:
                ticket.fail(InputError("the server shut down before this request was started"))
            self.pending.clear()
            self.cv.notify()
        self.thread.join()
        self.engine.close()
        self.reader.shutdown(wait=False, cancel_futures=True)
        self.contexts.clear()

    # ---- the loop thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.pending and not self.live and not self.preparing and self.accepting:
                    self.cv.wait()
                if not self.accepting:  # requests not yet started end as the queued ones did
                    self._abandon_preparations()
                    if not self.live:
                        return
                waiting = list(self.pending)
            self._read_keys(waiting)
            with self.cv:
                admit = self._choose()
            for ticket in admit:
                self._admit(ticket)
            self._read_ahead()
            self._prepare()
            self._join()
            self._cancel_marked()
            if self._drain_until is not None and time.perf_counter() > self._drain_until:
                for ticket in list(self.live.values()):
                    ticket.cancel()
                self._cancel_marked()
            if self.live:
                self._round()

    def _read_keys(self, tickets: Sequence[Ticket]) -> None:
        for ticket in tickets:
            if ticket.key is None and ticket.key_error is None:
                try:
                    req = ticket.request
                    ticket.key = self.contexts.key(req.video, req.video_options, req.system)
                except HippoError as exc:
                    ticket.key_error = exc

    def _choose(self) -> list[Ticket]:
        """The queued requests to admit between two rounds (see the module doc), in queue order;
        a request about a new video that must wait for a later round keeps its place, and so does one
        whose video key was not read yet (it came after `_read_keys`: requests with no key would
        share one preparation, the first one's video)."""
        waiting = sum(len(p.tickets) for p in self.preparing.values())  # admitted, not yet rows
        room = self.max_batch - len(self.live) - waiting
        if self.live and self.prefills_per_round is not None:
            room = min(room, self.prefills_per_round)
        prepares = self.prepares_per_round if self.live else None
        admit, keep, new = [], collections.deque(), set(self.preparing)
        for ticket in self.pending:
            if ticket.key is None and ticket.key_error is None:  # came after `_read_keys`: next time
                keep.append(ticket)
                continue
            fresh = ticket.key is not None and not self.contexts.holds(ticket.key) and ticket.key not in new
            if len(admit) >= room or (fresh and prepares is not None and len(new) >= prepares):
                keep.append(ticket)
                continue
            admit.append(ticket)
            if fresh:
                new.add(ticket.key)  # a second request about it waits for the same preparation
        self.pending = keep
        return admit

    def _admit(self, ticket: Ticket) -> None:
        """Start the ticket's row on its video's context, or have it wait for the context's preparation."""
        if ticket.key_error is None and not self.contexts.holds(ticket.key):
            with self.cv:  # `_read_ahead` (on the media thread too) looks at both
                prep = self.preparing.get(ticket.key)
                if prep is None:
                    reading = self.read_ahead.pop(ticket.key, None) or self._read(ticket)
                    prep = self.preparing[ticket.key] = _Preparation(reading)
            prep.tickets.append(ticket)
            return
        self._start(ticket, None)

    def _read_ahead(self) -> None:
        """Start reading the first queued new video's file on the media thread (`READ_AHEAD` at a
        time), while its request waits for room or for the preparations before it."""
        with self.cv:
            if len(self.read_ahead) >= READ_AHEAD:
                return
            waiting = list(self.pending)
        self._read_keys(waiting)
        with self.cv:  # `_admit` starts preparations under it
            for ticket in waiting:
                key = ticket.key
                if len(self.read_ahead) >= READ_AHEAD:
                    return
                if key is None or key in self.preparing or key in self.read_ahead or self.contexts.holds(key):
                    continue
                self.read_ahead[key] = self._read(ticket)

    def _read(self, ticket: Ticket) -> concurrent.futures.Future:
        """The ticket's video file read on the media thread (`ContextCache.read`)."""
        req = ticket.request
        reading = self.reader.submit(self.contexts.read, req.video, req.video_options, req.system)
        reading.add_done_callback(self._wake)  # an idle loop waits for it (`_prepare`)
        return reading

    def _wake(self, _: Any = None) -> None:
        with self.cv:
            self.cv.notify()

    def _prepare(self) -> None:
        """Steps of each video's preparation while rows wait at the start of this pass (up to
        `prefill_seconds`, at least one), all of it while none does; a prepared video's waiting
        requests are admitted at once (their first tokens) and join at the end of the pass. So videos that arrive
        together at an idle server are all prepared in one pass: the rows of the first ones wait for
        the later ones once, after their first token, and the later ones' first tokens do not wait
        for rounds of the first ones between their pieces."""
        stepwise = self._rows_wait
        if not stepwise and self.preparing:  # nothing else to run: wait for a reading or a new request
            with self.cv:
                queued = len(self.pending)
                self.cv.wait_for(
                    lambda: (
                        len(self.pending) > queued
                        or any(p.steps is not None or p.reading.done() for p in self.preparing.values())
                    ),
                    timeout=0.05,
                )
        for key, prep in list(self.preparing.items()):
            for ticket in [t for t in prep.tickets if t.cancelled.is_set()]:
                prep.tickets.remove(ticket)
                ticket.fail(InputError("cancelled before it started"))
            if not prep.tickets:  # nobody waits for it any more
                self._drop(key)
                continue
            if prep.steps is None and not prep.reading.done():
                if stepwise or not self._rows_wait:  # (nothing run in this pass yet: the queue first)
                    continue
                # read while another video of the burst was prepared: its first rows wait for it once
                concurrent.futures.wait([prep.reading], timeout=BURST_READ_WAIT)
                if not prep.reading.done():
                    continue
            t0, waiting = time.perf_counter(), self._rows_wait
            try:
                if prep.steps is None:  # with no live row it runs whole: its prefill in one piece
                    rows = self.prefill_rows if stepwise else None
                    prep.steps = self.contexts.prepare(prep.reading.result(), key, rows)
                if stepwise:  # steps until the budget is spent (at least one)
                    ctx = next(prep.steps)
                    while ctx is None and time.perf_counter() - t0 < self.prefill_seconds:
                        ctx = next(prep.steps)
                else:
                    ctx = collections.deque(prep.steps, maxlen=1)[0]
            except Exception as exc:
                del self.preparing[key]
                error = exc if isinstance(exc, HippoError) else None
                for ticket in prep.tickets:
                    ticket.fail(
                        error or InputError(f"the request failed while preparing it: {one_line(exc)}")
                    )
                continue
            finally:
                if waiting:
                    self.stall_seconds.append(time.perf_counter() - t0)
            if ctx is not None:
                del self.preparing[key]
                for ticket in prep.tickets:
                    self._start(ticket, ctx)

    def _drop(self, key: tuple) -> None:
        prep = self.preparing.pop(key)
        prep.reading.cancel()
        if prep.steps is not None:
            prep.steps.close()

    def _abandon_preparations(self) -> None:
        for reading in self.read_ahead.values():
            reading.cancel()
        self.read_ahead.clear()
        for key in list(self.preparing):
            for ticket in self.preparing[key].tickets:
                ticket.fail(InputError("the server shut down before this request was started"))
            self._drop(key)

    def _start(self, ticket: Ticket, ctx: Any) -> None:
        """Admit the ticket's request on `ctx` (None: the cached context of its key): its first token;
        its row joins the batch at the end of the pass (`_join`)."""
        if ticket.cancelled.is_set():
            ticket.fail(InputError("cancelled before it started"))
            return
        req, t0, waiting = ticket.request, time.perf_counter(), self._rows_wait
        admitted = False
        try:
            if ticket.key_error is not None:
                raise ticket.key_error
            if ctx is None:
                ctx = self.contexts.get(req.video, req.video_options, key=ticket.key, system=req.system)
            turn = Turn(ctx, text_question_ids(ctx, req.turns, req.system))
            generation = dict(req.generation)
            seed = generation.pop("seed", None)
            job = self.pipeline.job(turn=turn, seed=seed, streamer=ticket, **generation)
            L = int(turn.prompt_ids.shape[0])
            # the answer ends at the context's end: "length", as at max_tokens
            job.max_new_tokens = min(job.max_new_tokens, self.pipeline.target_adapter.context_length() - L)
            job.logprobs, ticket.job = req.logprobs, job
            ticket.notify(("started", {"prompt_tokens": L}))
            self.engine.expected_rows = len(self.live) + len(self.admitted) + 1 + len(self.pending)
            admitted = self.engine.admit(ticket.job)
        except Exception as exc:
            self._failed(ticket, exc)
            return
        finally:
            if waiting and not admitted:
                self.stall_seconds.append(time.perf_counter() - t0)
        if admitted:  # its first token is out; it joins at the end of this pass (`_join`)
            self.admitted.append((ticket, time.perf_counter() - t0, waiting))
        else:
            self._end(ticket)

    @property
    def _rows_wait(self) -> bool:
        """Rows wait for the work done now: live ones, or ones whose first token is out (admitted)."""
        return bool(self.live or self.admitted)

    def _join(self) -> None:
        """The rows admitted in this pass join the batch (the draft's prefill of each): after all their
        first tokens, so that no first token waits for another request's draft. A row's admission and
        join are one step of `stall_seconds`."""
        admitted, self.admitted = self.admitted, []
        for ticket, seconds, waiting in admitted:
            t0, waiting = time.perf_counter(), waiting or bool(self.live)
            try:
                self.engine.join(ticket.job)
            except Exception as exc:
                self._failed(ticket, exc)
                continue
            finally:
                if waiting:
                    self.stall_seconds.append(seconds + time.perf_counter() - t0)
            self.live[id(ticket.job)] = ticket

    @staticmethod
    def _failed(ticket: Ticket, exc: Exception) -> None:
        if isinstance(exc, HippoError):
            ticket.fail(exc)
        else:  # a bug or a backbone error: this request fails, the server lives
            ticket.fail(InputError(f"the request failed while preparing it: {one_line(exc)}"))

    def _cancel_marked(self) -> None:
        for ticket in list(self.live.values()):
            if ticket.cancelled.is_set() or ticket.stopped:
                self.engine.cancel(ticket.job)
                self._end(ticket)

    def _round(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as exc:  # the round's rows are in an unknown state: they fail, not the server
            error = InputError(f"decoding failed: {one_line(exc)}")
            for ticket in list(self.live.values()):
                self.engine.cancel(ticket.job)
                self.live.pop(id(ticket.job), None)
                ticket.fail(error)
            return
        self.rounds += 1
        for job in finished:
            if job.error is not None:  # this request failed alone
                ticket = self.live.pop(id(job))
                error = job.error if isinstance(job.error, HippoError) else None
                ticket.fail(error or InputError(f"decoding this request failed: {one_line(job.error)}"))
                continue
            self._end(self.live[id(job)])
        self._cancel_marked()  # stop strings reached in this round
        if self.on_round is not None:
            self.on_round(self)

    def _end(self, ticket: Ticket) -> None:
        self.live.pop(id(ticket.job), None)
        job = ticket.job
        last = job.tokens[-1] if job.tokens else None
        reason = "stop" if ticket.stopped or (last is not None and last in job.eos_ids) else "length"
        if ticket.cancelled.is_set() and not ticket.stopped:
            reason = "cancelled"
        ticket.finish(
            {
                "finish_reason": reason,
                "prompt_tokens": int(job.prompt_ids.shape[0]),
                "completion_tokens": len(ticket.tokens),
                "text": ticket.text,
                "token_ids": list(ticket.tokens),
                "stats": job.stats,
                "seconds": time.perf_counter() - ticket.submitted,
            }
        )


class VideoOptionError(InputError):
    """A video option the context or the memory cannot take (`param`: which one)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def bound_video(pipeline: Any, path: str, options: dict[str, Any]) -> None:
    """Refuse video options before any frame is decoded: the frames they sample (read from the file's
    header) must fit the target's context (each frame, or each temporal patch of frames, takes at
    least one token: a lower bound on the prompt), the KV budget of a context that long
    (`hippo.context.check_budget`), and, decoded, a share of the free host memory. VideoOptionError
    names the option to lower."""
    try:
        import av
    except ImportError:  # no PyAV: the frames are decoded without this check
        return
    from hippo.context import MiB, available_bytes, estimate_bytes

    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            n_file, rate = int(stream.frames or 0), float(stream.average_rate or 0)
            width, height = int(stream.codec_context.width), int(stream.codec_context.height)
            if not n_file and stream.duration is not None and stream.time_base is not None:
                n_file = int(float(stream.duration * stream.time_base) * rate)
    except Exception:  # noqa: BLE001 - unreadable here: the decoder names what is wrong
        return
    frames, fps = options.get("frames"), options.get("fps")
    param = "frames" if frames is not None else "fps"
    if frames is not None:
        n = int(frames)  # more than the file has: the decoder's error names it
    elif n_file:
        n = min(n_file, max(1, math.floor(n_file / rate * (fps or 2.0)))) if rate > 0 else n_file
    else:
        return
    adapter = pipeline.target_adapter
    vision = getattr(adapter.model.config, "vision_config", None)
    temporal = int(getattr(vision, "temporal_patch_size", 1) or 1)
    tokens = math.ceil(n / temporal)  # at least one token per (temporal patch of) frame(s)
    ctx = adapter.context_length()
    if tokens >= ctx:
        raise VideoOptionError(
            f"{param}: {n} frames take at least {tokens} tokens but the target's context is {ctx}; ask "
            f"for fewer frames (frames= or a lower fps=)",
            param,
        )
    # the budget and the device's memory with every cached context evicted (the cache evicts for it)
    estimate, budget = estimate_bytes(adapter, tokens), pipeline.context_budget
    live = sum(c.nbytes for c in list(pipeline._contexts) if not c.closed)
    free = available_bytes(next(pipeline.target.parameters()).device)
    room = min(x for x in (budget, None if free is None else free + live, math.inf) if x is not None)
    if estimate > room:
        raise VideoOptionError(
            f"{param}: {n} frames take at least {tokens} tokens, whose context needs about "
            f"{estimate / MiB:.1f} MiB, but at most {room / MiB:.1f} MiB can be given to it; ask for "
            "fewer frames (frames= or a lower fps=)",
            param,
        )
    pixels = min(width * height, options.get("max_pixels") or width * height)
    need = n * (width * height * 3 + pixels * 3 * 4)  # uint8 frames, then float pixel values
    free = available_bytes(torch.device("cpu"))
    if free is not None and need > FRAME_MEMORY_SHARE * free:
        raise VideoOptionError(
            f"{param}: {n} frames of {width}x{height} need about {need / MiB:.0f} MiB decoded, but "
            f"{free / MiB:.0f} MiB are free; ask for fewer frames (frames= or a lower fps=) or a "
            "lower max_pixels",
            param,
        )


def check_media(path: str, media_dir: str) -> str:
    """The real path of `path` if it lies under `media_dir`; PermissionError otherwise, InputError
    for a path no file can have (a NUL byte, a name over the OS's limit)."""
    if "\x00" in path:
        raise InputError("the video path has a NUL byte; no file can have that name")
    try:
        real, root = os.path.realpath(path), os.path.realpath(media_dir)
    except (OSError, ValueError) as exc:
        raise InputError(
            f"the video path cannot name a file ({getattr(exc, 'strerror', None) or exc})"
        ) from None
    if os.path.commonpath([real, root]) != root:
        raise PermissionError(f"{path!r} is outside the media directory; only files under it are read")
    return real
