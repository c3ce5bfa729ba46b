"""In-process executors: `inline` (one after the other, or overlapped on a thread and a CUDA
stream: `ThreadDraftWorker`) and `simulated` (a virtual clock).

`simulated` computes exactly what `inline` computes, but charges every forward a chosen virtual
duration, so a test can force any interleaving of draft and target (how many tokens the draft has
buffered when the target finishes its prefill, how far a drafting got before an abort) and check
that the output never depends on it.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor

import attrs
import torch

from hippo import hookimpl
from hippo.executor import DraftFailure, DraftWorker, Executor, overlap_seconds
from hippo.job import DecodeJob
from hippo.proposal import DraftProposal


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive number of (virtual) seconds, got {value!r}")


class LocalDraftWorker(DraftWorker):
    """The job's draft side in this thread, sharing the job's policy. Drafting runs at `submit`;
    `stop` only trims (see subclasses)."""

    overlapped = False

    def __init__(self, job: DecodeJob):
        self.side = job.new_draft_side()
        self._pending: DraftProposal | None = None

    def prefill(self, keep: torch.Tensor | None) -> None:
        t0 = time.perf_counter()
        self.side.prefill(keep)
        self.seconds_prefill += time.perf_counter() - t0

    def submit(self, prefix: torch.Tensor, gamma: int) -> None:
        before = self.side.seconds_decode
        self._pending = self.side.propose(prefix, gamma)
        self.seconds_decode += self.side.seconds_decode - before
        self.tokens_drafted += self._pending.size

    def stop(self) -> None:
        pass

    def collect(self) -> DraftProposal:
        prop, self._pending = self._pending, None
        return prop

    def close(self) -> None:
        self.side.close()


class ThreadDraftWorker(DraftWorker):
    """A draft worker on a thread of this process, for `inline`'s overlap mode (one device, two models).

    On CUDA the draft's kernels go to a side stream, so they run while the target's kernels run on
    the current stream; the thread only keeps the Python side of drafting from blocking the target's.
    On CPU the thread overlaps the two models' operators (torch releases the GIL inside them), which is
    what the tests use to exercise this path without a GPU.

    One task at a time, in submission order (a single-thread pool): prefill, then drafting, both by
    the job's `DraftSide` with a forked policy (its own seeded generator), as in a draft process, so
    the two threads never share a random generator.

    A draft that raises on its thread falls back to the target alone, as with a draft process. There
    is no timeout: a thread cannot be killed, so a hanging draft hangs the call; the `process`
    executor is the one that isolates faults.
    """

    def __init__(self, job: DecodeJob, target_busy: list[tuple[float, float]]):
        self.side = job.new_draft_side(own_policy=True)
        device = self.side.adapter.device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hippo-draft")
        self._tasks: list[Future] = []
        self._ticket = 0
        self._stop_ticket = -1
        self.target_busy = target_busy
        self.draft_busy: list[tuple[float, float]] = []

    # ---- runs on the draft thread -------------------------------------------------------------
    def _run(self, kind: str, fn, ready: torch.cuda.Event | None):
        t0 = time.perf_counter()
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            if ready is not None:  # inputs the caller made on its stream are complete
                self.stream.wait_event(ready)
            out = fn()
        if self.stream is not None:
            self.stream.synchronize()
        t1 = time.perf_counter()
        self.draft_busy.append((t0, t1))
        if kind == "prefill":
            self.seconds_prefill += t1 - t0
        else:
            self.seconds_decode += t1 - t0
        return out

    def _propose(self, prefix: torch.Tensor, gamma: int, ticket: int) -> DraftProposal:
        prop = self.side.propose(prefix, gamma, lambda: self._stop_ticket == ticket)
        self.tokens_drafted += prop.size
        # hand back host tensors: nothing the side stream allocated is used on another stream
        return prop.cpu()

    # ---- called by the scheduler's thread -----------------------------------------------------
    def _launch(self, kind: str, fn) -> Future:
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.stream.device))
        task = self.pool.submit(self._run, kind, fn, ready)
        self._tasks.append(task)
        return task

    def prefill(self, keep: torch.Tensor | None) -> None:  # keep [K]
        self._launch("prefill", lambda: self.side.prefill(keep))

    def submit(self, prefix: torch.Tensor, gamma: int) -> None:  # prefix [T]
        self._ticket += 1
        ticket = self._ticket
        self._launch("decode", lambda: self._propose(prefix, gamma, ticket))

    def stop(self) -> None:
        self._stop_ticket = self._ticket

    def collect(self) -> DraftProposal:
        tasks, self._tasks = self._tasks, []
        result = None
        for task in tasks:  # prefills queued before the drafting surface their errors here too
            try:
                result = task.result()
            except Exception as exc:
                raise DraftFailure(f"the draft raised on its thread: {type(exc).__name__}: {exc}") from exc
        if not isinstance(result, DraftProposal):
            raise DraftFailure("collect() was called with no drafting in flight")
        return result

    @property
    def seconds_overlapped(self) -> float:  # computed when read (a job's end), not every round
        return overlap_seconds(self.draft_busy, self.target_busy)

    def close(self) -> None:
        self.stop()
        for task in self._tasks:
            with contextlib.suppress(Exception):
                task.result()
        self._tasks = []
        self.pool.shutdown(wait=True)
        self.side.close()


class InlineExecutor(Executor):
    """Draft and target in one process: for debugging and single-device use.

    `overlap`: "off" runs them one after the other (drafting happens at `submit`). "thread" runs
    the draft on a thread of this process and, when the draft is on CUDA, on its own CUDA stream,
    so its kernels overlap the target's. "auto" (default) is "thread" when the draft model is on a
    CUDA device and is not the target model itself (a self-drafting model must not run two
    forwards at once: the attention scorer's hooks sit on it), else "off".
    """

    @attrs.frozen
    class Config:
        overlap: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "off", "thread")))

    def overlaps(self, job: DecodeJob) -> bool:
        return self.threaded(job)

    def threaded(self, job: DecodeJob) -> bool:
        p = job.pipeline
        if self.config.overlap == "off" or p.draft_adapter.model is p.target_adapter.model:
            return False
        return self.config.overlap == "thread" or p.draft_adapter.device.type == "cuda"

    def open(self, job: DecodeJob) -> DraftWorker:
        self.target_busy = []
        return ThreadDraftWorker(job, self.target_busy) if self.threaded(job) else LocalDraftWorker(job)


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.target_busy: list[tuple[float, float]] = []

    def run_target(self, duration: float) -> None:
        self.target_busy.append((self.now, self.now + duration))
        self.now += duration


class SimulatedDraftWorker(LocalDraftWorker):
    """Drafts at `submit` like inline, then replays the work on the virtual clock.

    Its seconds (prefill, decode, overlapped) are virtual, so they compare with each other.
    """

    overlapped = True  # on the virtual clock
    virtual = True  # its seconds do not compare with the target session's real ones

    def __init__(self, job: DecodeJob, cfg: SimulatedExecutor.Config, clock: VirtualClock):
        super().__init__(job)
        self.cfg, self.clock = cfg, clock
        self.free_at = 0.0  # virtual time the draft finishes its queued work
        self.busy: list[tuple[float, float]] = []
        self._done_at: list[float] = []  # virtual completion time of each in-flight token
        self._virtual = {"prefill": 0.0, "decode": 0.0}
        self._virtual_tokens = 0  # draft tokens finished on the virtual clock

    def _work(self, start: float, duration: float, kind: str) -> None:
        self.free_at = start + duration
        self.busy.append((start, self.free_at))
        self._virtual[kind] += duration

    def prefill(self, keep: torch.Tensor | None) -> None:
        super().prefill(keep)
        self._work(max(self.free_at, self.clock.now), self.cfg.draft_prefill, "prefill")
        self.seconds_prefill = self._virtual["prefill"]

    def submit(self, prefix: torch.Tensor, gamma: int) -> None:
        super().submit(prefix, gamma)
        start = max(self.free_at, self.clock.now)
        self._done_at = [start + (i + 1) * self.cfg.draft_forward for i in range(self._pending.size)]

    def stop(self) -> None:
        """Keep only the tokens finished by now on the virtual clock."""
        done = sum(t <= self.clock.now for t in self._done_at)
        if done < self._pending.size:
            self._pending = self._pending.truncate(done)
            self._done_at = self._done_at[:done]

    def collect(self) -> DraftProposal:
        if self._done_at:
            n = len(self._done_at)
            self._work(self._done_at[-1] - n * self.cfg.draft_forward, n * self.cfg.draft_forward, "decode")
            self._virtual_tokens += n
            self.clock.now = max(self.clock.now, self._done_at[-1])  # waiting for the draft
        self._done_at = []
        self.seconds_decode, self.tokens_drafted = self._virtual["decode"], self._virtual_tokens
        return super().collect()

    @property
    def seconds_overlapped(self) -> float:  # computed when read (a job's end), not every round
        return overlap_seconds(self.busy, self.clock.target_busy)


class SimulatedExecutor(Executor):
    """Inline computation on a virtual clock with chosen durations (virtual seconds)."""

    @attrs.frozen
    class Config:
        target_prefill: float = attrs.field(default=10.0, validator=_positive)
        target_forward: float = attrs.field(default=4.0, validator=_positive)
        draft_prefill: float = attrs.field(default=2.0, validator=_positive)
        draft_forward: float = attrs.field(default=1.0, validator=_positive)

    def __init__(self, config=None):
        super().__init__(config)
        self.clock = VirtualClock()

    def overlaps(self, job: DecodeJob) -> str:
        """Beside the target on the virtual clock only: a batch drafts its next blocks in the
        caller's thread ("inline"), the same blocks a draft thread would draft."""
        return "inline"

    def open(self, job: DecodeJob) -> DraftWorker:
        self.clock = VirtualClock()
        return SimulatedDraftWorker(job, self.config, self.clock)

    def target(self, kind: str, fn, *args, **kwargs):
        out = fn(*args, **kwargs)
        self.clock.run_target(self.config.target_prefill if kind == "prefill" else self.config.target_forward)
        return out


@hookimpl
def hippo_register_executors():
    return {"inline": InlineExecutor, "simulated": SimulatedExecutor}
