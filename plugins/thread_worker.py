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

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hippo.accept import DraftProposal
from hippo.executor import DraftFailure, DraftWorker, overlap_seconds
from hippo.job import DecodeJob


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


class ThreadDraftWorker(DraftWorker):
    def __init__(self, job: DecodeJob, target_busy: list[tuple[float, float]]):
        self.side = job.new_draft_side(own_policy=True)
        device = model_device(self.side.adapter.model)
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
        self.seconds_overlapped = overlap_seconds(self.draft_busy, self.target_busy)
        if not isinstance(result, DraftProposal):
            raise DraftFailure("collect() was called with no drafting in flight")
        return result

    def close(self) -> None:
        self.stop()
        for task in self._tasks:
            with contextlib.suppress(Exception):
                task.result()
        self._tasks = []
        self.pool.shutdown(wait=True)
        self.side.close()
