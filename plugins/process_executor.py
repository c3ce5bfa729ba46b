"""The `process` executor: the draft lives in its own process, on its own cores or device.

Transport is torch.multiprocessing (a fork server, or spawn): command and result queues, pickled in the
sender's thread, whose small CPU tensors travel by value and the others through shared memory (CUDA
IPC on a GPU), and one shared integer that asks the in-flight drafting to stop. The child
holds the draft model (shared, not copied) and rebuilds its adapter with the adapter's own
`options`; the job's `DraftSide` there encodes the video with the draft's own vision tower (for a
video context's question: the prefix's encoding, kept in the child for its last `contexts` contexts,
plus the question's tokens), prefills on the kept visual tokens and drafts on request, reporting the
wall-clock interval of every piece of work so the parent can measure how much draft time was hidden
behind the target.

The draft runs where its weights are: on the device the builder put it on (`--draft-device cuda:3`,
`PipelineBuilder.devices(draft_device=...)`), whose tensors the child shares with the parent (CUDA
IPC, or shared memory on the CPU), and the child makes that device its current one. So the paper's
layout, a target spread over three GPUs and the draft on a fourth, is a draft process on the fourth.

A parallel batch's draft rows live there too (`ProcessBatchDraft`, `hippo.engine.DraftRows` in the
child): each row's pruned prefill, stacked with the others, its chains drafted there while the
target verifies, its rows dropped as they leave.

The process starts on first use, is reused by later `generate` calls, and is shut down by
`Pipeline.close()` or garbage collection (a weakref finaliser): no zombie is left behind. A draft
that dies, raises, or does not answer within `timeout` seconds raises `DraftFailure`, and the
scheduler finishes with the target alone.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import queue
import time
import traceback
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

import attrs
import torch
import torch.multiprocessing as mp

from hippo import hookimpl
from hippo.compat import drop_output_capturing_hooks, register_output_capturing
from hippo.context import EncodingStore
from hippo.draft import DraftSide
from hippo.engine import DraftRows
from hippo.executor import BatchDraft, DraftFailure, DraftWorker, Executor, overlap_seconds
from hippo.job import DecodeJob
from hippo.placement import input_device
from hippo.proposal import DraftProposal
from hippo.validators import positive_int

#: a CPU tensor up to this size crosses the queues by value, in the pickle; a larger one (a sampled
#: draft's laws [γ, V] on a real vocabulary) through shared memory. Passing a storage through shared
#: memory costs a socket connection to the sender's resource sharer and a mapping, about 1-2 ms on a
#: 2-core EPYC, where 256 KiB by value costs a few tenths of a millisecond.
INLINE_BYTES = 256 * 1024


def _inline_tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class _Pickler(ForkingPickler):
    """torch.multiprocessing's pickler (tensors through shared memory, CUDA tensors by IPC handle), but
    small CPU tensors by value (`INLINE_BYTES`)."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is torch.Tensor
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
            and not obj.is_quantized
            and obj.nbytes <= INLINE_BYTES
        ):
            flat = obj.detach().contiguous().reshape(-1).view(torch.uint8)
            return _inline_tensor, (flat.numpy().tobytes(), obj.dtype, tuple(obj.shape))
        return NotImplemented


def _pack(payload: Any) -> bytes:
    """`payload` pickled *now*, in the calling thread, for a queue.

    A queue would pickle in a background feeder thread, and pickling a large CPU tensor moves its
    storage to shared memory in place, freeing the old buffer: had that happened while this process
    still read the tensor (the target encoding the same pixel values), the reader would touch freed
    memory. The receiver unpickles with `pickle.loads`.
    """
    buf = io.BytesIO()
    _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(payload)
    return buf.getvalue()


def _portable(exc: BaseException | None) -> BaseException | None:
    """An exception that crosses the queue: itself where it pickles, else its type and message."""
    if exc is None:
        return None
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _side(adapter, store: EncodingStore, payload: tuple) -> DraftSide:
    """A job's draft side in the draft process. payload: its inputs, its draft policy (forked: its
    own generator), drafter, session kind, new tokens, and a video context's `DraftPrefix` or None."""
    inputs, policy, drafter, sessions, new_tokens, prefix = payload
    encode = None if prefix is None else functools.partial(prefix.encode, adapter, store)
    return DraftSide(adapter, drafter, inputs, policy, encode, sessions, new_tokens)


def _worker_main(model, adapter_cls, adapter_options, threads, contexts, cmd_q, res_q, stop_ticket) -> None:
    """The draft process: serve commands in order: a job alone's ("job" | "prefill" | "propose"), a
    batch's draft rows' ("rows_join" | "rows_draft" | "rows_select" | "rows_close"), "close"."""
    torch.set_num_threads(threads)
    device = input_device(model)  # the draft's own device (--draft-device): shared with the parent
    if device.type == "cuda":  # this process's kernels, streams and new tensors go there
        torch.cuda.set_device(device)
    register_output_capturing(model)  # what building the model registers, in the parent only
    adapter = adapter_cls(model, **adapter_options)
    side: DraftSide | None = None
    rows: DraftRows | None = None  # a batch's draft rows (`ProcessBatchDraft`)
    store = EncodingStore(contexts)  # the draft's encoded video prefixes of recent video contexts
    parent = mp.parent_process()
    while True:
        try:
            cmd, ticket, payload = pickle.loads(cmd_q.get(timeout=1.0))
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return  # the parent was killed: do not linger as an orphan
            continue
        if cmd == "close":
            return
        t0 = time.perf_counter()
        try:
            result: Any = None
            if cmd == "job":
                if side is not None:
                    side.close()
                side = _side(adapter, store, payload)
            elif cmd == "rows_join":  # q's pruned prefill of a row, stacked as the last row
                job, keep, prompt_ids = payload
                joining = _side(adapter, store, job)
                if rows is None:
                    rows = DraftRows(joining.drafter, joining.sessions, model)
                rows.join(joining.prefill(keep), prompt_ids, joining.policy)
            elif cmd == "rows_draft":
                drafted, chains, seconds, forwards, errors = rows.draft(*payload)
                result = (drafted, chains, seconds, forwards, [_portable(e) for e in errors])
            elif cmd == "rows_select":
                rows.select(payload)
            elif cmd == "rows_close":
                rows = None
            elif cmd == "prefill":
                side.prefill(payload)
            elif cmd == "propose":
                prefix, gamma = payload

                def should_stop(mine: int = ticket) -> bool:
                    return stop_ticket.value == mine

                result = side.propose(prefix, gamma, should_stop)
            else:
                raise ValueError(f"unknown command {cmd!r}")
            res_q.put(_pack(("ok", ticket, cmd, result, (t0, time.perf_counter()))))
        except Exception:
            res_q.put(_pack(("error", ticket, cmd, traceback.format_exc(limit=8), (t0, time.perf_counter()))))


def _shutdown(proc, cmd_q) -> None:
    if proc.is_alive():
        try:
            cmd_q.put(_pack(("close", -1, None)))
        except (OSError, ValueError):
            pass
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def _context(model: torch.nn.Module, adapter_cls: type) -> Any:
    """The start method of draft processes: a fork server where the platform has one (Linux, macOS),
    which imports torch, transformers' model module and hippo once, so each draft process starts in
    well under a second instead of re-importing them (several seconds); spawn elsewhere. The server
    never runs a torch op or touches CUDA, so forking from it is safe."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # takes effect when the server starts (the first draft process of this Python process)
    ctx.set_forkserver_preload([__name__, type(model).__module__, adapter_cls.__module__])
    return ctx


class _DraftProcess:
    """The child process and its queues, owned by one ProcessExecutor."""

    def __init__(self, model, adapter_cls, adapter_options: dict, threads: int, contexts: int):
        ctx = _context(model, adapter_cls)
        self.cmd_q, self.res_q = ctx.Queue(), ctx.Queue()
        self.stop_ticket = ctx.Value("q", -1, lock=False)
        drop_output_capturing_hooks(model)  # local functions: the model would not pickle
        saved = os.environ.get("OMP_WAIT_POLICY")
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # spinning OpenMP threads starve the other process
        try:
            self.proc = ctx.Process(
                target=_worker_main,
                args=(
                    model,
                    adapter_cls,
                    adapter_options,
                    threads,
                    contexts,
                    self.cmd_q,
                    self.res_q,
                    self.stop_ticket,
                ),
                daemon=True,
                name="hippo-draft",
            )
            self.proc.start()
        finally:
            if saved is None:
                os.environ.pop("OMP_WAIT_POLICY", None)
            else:
                os.environ["OMP_WAIT_POLICY"] = saved
        self._finalizer = weakref.finalize(self, _shutdown, self.proc, self.cmd_q)
        self.ticket = 0

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def send(self, cmd: str, payload: Any) -> int:
        if not self.alive:
            raise DraftFailure(f"the draft process is not running (exit code {self.proc.exitcode})")
        self.ticket += 1
        self.cmd_q.put(_pack((cmd, self.ticket, payload)))
        return self.ticket

    def receive(self, deadline: float, timeout: float) -> tuple:
        """The next result: (ticket, command, result, span); `DraftFailure` where the command raised
        in the child, or the process died or gave none by `deadline` (time.monotonic())."""
        while True:
            try:
                status, ticket, cmd, result, span = pickle.loads(self.res_q.get(timeout=0.05))
            except queue.Empty:
                if not self.alive:
                    raise DraftFailure(f"the draft process died (exit code {self.proc.exitcode})") from None
                if time.monotonic() > deadline:
                    self.close()
                    raise DraftFailure(f"the draft process gave no answer within {timeout} s") from None
                continue
            if status == "error":
                raise DraftFailure(f"the draft raised during {cmd}: {result.strip().splitlines()[-1]}")
            return ticket, cmd, result, span

    def close(self) -> None:
        self._finalizer()


def _draft_side(job: DecodeJob, policy: Any) -> tuple:
    """What the child needs to draft for `job` (its inputs, the draft policy `policy`, the drafter,
    the draft session kind, its length and its draft prefix), as `_side` takes it in the child."""
    p = job.pipeline
    return (
        dict(job.inputs),
        policy,
        p.drafter,
        p.sessions["draft"],
        job.max_new_tokens,
        job.source.draft_prefix(),
    )


class ProcessDraftWorker(DraftWorker):
    def __init__(self, executor: ProcessExecutor, job: DecodeJob):
        self.ex, self.job = executor, job
        self.dp = executor.process_for(job)
        self.target_busy = executor.target_busy = []
        self.draft_busy: list[tuple[float, float]] = []
        self._inflight: int | None = None
        self._asked: tuple[int, int] = (-1, 0)  # the in-flight drafting's (start position, γ)
        # the draft side's policy: forked here (the child's own generator), the target's V inside
        self.dp.send("job", _draft_side(job, job.policy.fork()))

    def _wait(self, ticket: int):
        """Read results until `ticket`'s arrives; every other result is bookkeeping."""
        deadline = time.monotonic() + self.ex.config.timeout
        while True:
            t, cmd, result, span = self.dp.receive(deadline, self.ex.config.timeout)
            self.draft_busy.append(span)
            if self.job.events is not None and cmd in ("prefill", "propose"):
                self._book(t, cmd, result, span)
            if cmd == "prefill":
                self.seconds_prefill += span[1] - span[0]
            elif cmd == "propose":
                self.seconds_decode += span[1] - span[0]
                self.tokens_drafted += result.size
            if t == ticket:
                return result

    @property
    def seconds_overlapped(self) -> float:  # computed when read (a job's end), not every round
        return overlap_seconds(self.draft_busy, self.target_busy)

    def _book(self, ticket: int, cmd: str, result: Any, span: tuple[float, float]) -> None:
        """The child's work on the job's event record (its clock is the parent's: see hippo.events)."""
        if cmd == "prefill":  # includes the draft's first vision encoding, done in the child
            self.job.events.add("draft", "prefill", *span)
            return
        pos, gamma = self._asked
        stopped = self.dp.stop_ticket.value == ticket and result.depth < gamma
        self.job.events.add(
            "draft", "draft", *span, pos=pos, n=result.size, depth=result.depth, gamma=gamma, stopped=stopped
        )

    def prefill(self, keep: torch.Tensor | None) -> None:
        self.dp.send("prefill", keep)

    def submit(self, prefix: torch.Tensor, gamma: int) -> None:
        self._inflight = self.dp.send("propose", (prefix, gamma))
        self._asked = (prefix.shape[0], gamma)

    def stop(self) -> None:
        if self._inflight is not None:
            self.dp.stop_ticket.value = self._inflight

    def collect(self) -> DraftProposal:
        ticket, self._inflight = self._inflight, None
        return self._wait(ticket)

    def close(self) -> None:
        if self._inflight is not None and self.dp.alive:
            self.stop()
            try:
                self.collect()
            except DraftFailure:
                pass
        self.ex.restore_threads()


class ProcessBatchDraft(BatchDraft):
    """A batch's draft rows in the draft process (`hippo.engine.DraftRows` there): q's prefill of
    each row that joins, its chains, its rows leaving. The engine's process keeps `threads` CPU
    threads for p's verification while the batch lives, as a job alone does; p's prefills take
    `prefill_threads`."""

    def __init__(self, executor: ProcessExecutor, job: DecodeJob):
        self.ex = executor
        self.dp = executor.process_for(job)
        self._threads = torch.get_num_threads()
        torch.set_num_threads(executor.config.threads)
        self.dp.send("rows_close", None)  # a batch of its own (what an earlier one left is dropped)

    def _wait(self, ticket: int) -> tuple[Any, tuple[float, float]]:
        """Ticket's result and its span; the results of commands not waited for come first."""
        deadline = time.monotonic() + self.ex.config.timeout
        while True:
            t, cmd, result, span = self.dp.receive(deadline, self.ex.config.timeout)
            if t == ticket:
                return result, span

    def join(self, job: DecodeJob, policy: Any) -> None:
        side = _draft_side(job, policy)
        _, span = self._wait(self.dp.send("rows_join", (side, job.prune(), job.prompt_ids)))
        job.stats.seconds_draft_prefill += span[1] - span[0]  # its vision encoding included
        if job.events is not None:
            job.events.add("draft", "prefill", *span)

    def draft(self, bases: list[list[int]], gammas: list[int]):
        return self._wait(self.dp.send("rows_draft", (bases, gammas)))[0]

    def select(self, keep: list[int]) -> None:
        self.dp.send("rows_select", keep)  # its answer is read before the next one waited for

    def target(self, kind: str, fn, *args):
        # not `ex.target`: its list of timed intervals would grow with every round of a long batch
        with self.ex.threads_for(kind):
            return fn(*args)

    def close(self) -> None:
        if self._threads is None:
            return
        torch.set_num_threads(self._threads)
        self._threads = None
        if self.dp.alive:
            self.dp.send("rows_close", None)


class ProcessExecutor(Executor):
    """Draft in a child process; each process gets `threads` CPU threads (one core per model on 2 cores)."""

    @attrs.frozen
    class Config:
        threads: int = attrs.field(default=1, validator=positive_int)
        timeout: float = attrs.field(default=120.0, validator=attrs.validators.gt(0))
        #: threads for the target's prefill (None: `threads`); more than `threads` borrows the draft's
        #: cores while the draft is mostly idle (it only prefills its pruned input and buffers γ). Not
        #: for a video context's question ("extend"): a few tokens gain nothing from more threads,
        #: and lose to the draft buffering beside them (measured: 70-100 ms against 40-45 ms for 9)
        prefill_threads: int | None = attrs.field(
            default=None, validator=attrs.validators.optional(positive_int)
        )
        #: video contexts whose draft encoding the draft process keeps (least recently used dropped)
        contexts: int = attrs.field(default=4, validator=positive_int)

    def overlaps(self, job: DecodeJob) -> bool:
        return True

    def __init__(self, config=None):
        super().__init__(config)
        self._dp: _DraftProcess | None = None
        self._key = None
        self._saved_threads: int | None = None

    def process_for(self, job: DecodeJob) -> _DraftProcess:
        adapter = job.pipeline.draft_adapter
        key = (id(adapter.model), type(adapter), adapter.options)
        if self._dp is None or not self._dp.alive or self._key != key:
            if self._dp is not None:
                self._dp.close()
            cfg = self.config
            self._dp = _DraftProcess(adapter.model, type(adapter), adapter.options, cfg.threads, cfg.contexts)
            self._key = key
        return self._dp

    def batch_draft(self, job: DecodeJob) -> BatchDraft:
        return ProcessBatchDraft(self, job)

    def open(self, job: DecodeJob) -> DraftWorker:
        self._saved_threads = torch.get_num_threads()
        torch.set_num_threads(self.config.threads)
        try:
            return ProcessDraftWorker(self, job)
        except BaseException:
            self.restore_threads()
            raise

    def restore_threads(self) -> None:
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None

    @contextlib.contextmanager
    def threads_for(self, kind: str):
        """The target's CPU threads for `kind` of work: `prefill_threads` for a prefill."""
        threads = torch.get_num_threads()
        if kind == "prefill" and self.config.prefill_threads is not None:
            torch.set_num_threads(self.config.prefill_threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def target(self, kind: str, fn, *args, **kwargs):
        with self.threads_for(kind):
            return super().target(kind, fn, *args, **kwargs)

    @property
    def pid(self) -> int | None:
        return None if self._dp is None else self._dp.proc.pid

    def close(self) -> None:
        if self._dp is not None:
            self._dp.close()
            self._dp = None


@hookimpl
def hippo_register_executors():
    return {"process": ProcessExecutor}
