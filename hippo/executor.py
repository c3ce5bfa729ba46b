"""Executors decide *where and when* the draft runs next to the target; never *what* is emitted.

The target always runs in the calling process and owns the output. The draft runs behind a
`DraftWorker`, which a parallel scheduler drives asynchronously:

    worker.prefill(keep)          # start the draft's (pruned) prefill
    worker.submit(prefix, γ)      # start drafting γ tokens after `prefix`
    ... target work via executor.target(...) ...
    worker.stop()                 # optional: end the in-flight drafting early
    proposal = worker.collect()   # wait for it (holds the tokens drafted so far)

Any failure of the draft side surfaces as `DraftFailure`; schedulers then finish with the target alone.

A batch of a parallel schedule drafts beside p too. Its draft rows live in the engine's process (a
thread beside p) unless the executor gives them a place of their own, a `BatchDraft` (a draft
process): the engine's round then drives them there, one request at a time:

    rows.join(job, policy)        # q's pruned prefill of a row that joins, stacked with the others
    rows.draft(bases, γs)         # each row's chain after its tokens `bases[b]`, on the host
    rows.select(keep)             # the rows that stay after some left
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from hippo.errors import HippoError
from hippo.interfaces import Component, Job

if TYPE_CHECKING:
    from hippo.proposal import DraftProposal

T = TypeVar("T")


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sets of disjoint [start, end) intervals (seconds), in
    one sweep over both in order: workers call it every round on their growing lists of busy spans."""
    a, b = sorted(a), sorted(b)  # already in order where they were appended as the work happened
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        (s1, e1), (s2, e2) = a[i], b[j]
        total += max(0.0, min(e1, e2) - max(s1, s2))
        if e1 < e2:  # a[i] ends first: no later interval of b meets it
            i += 1
        else:
            j += 1
    return total


class DraftFailure(HippoError):
    """The draft died, hung past its timeout, or raised; generation continues with the target alone."""


class DraftWorker(ABC):
    """The draft model with its own KV cache, possibly in another process. One request in flight."""

    seconds_prefill: float = 0.0
    seconds_decode: float = 0.0
    #: draft tokens made in `seconds_decode`, kept or discarded (its seconds per draft token)
    tokens_drafted: int = 0
    #: seconds the draft spent working while the target was also working (hidden draft time)
    seconds_overlapped: float = 0.0
    #: the draft works while the target does (a thread, a process); False: one after the other
    overlapped: bool = True
    #: its seconds are on a virtual clock (the simulated executor): not comparable with real ones
    virtual: bool = False

    @abstractmethod
    def prefill(self, keep: torch.Tensor | None) -> None:  # keep [K] kept visual indices
        """Start (or restart) the draft's prefill on the kept visual tokens."""

    @abstractmethod
    def submit(self, prefix: torch.Tensor, gamma: int) -> None:  # prefix [T]
        """Start drafting γ tokens that continue `prefix`."""

    @abstractmethod
    def stop(self) -> None:
        """Ask the in-flight drafting to end as soon as possible."""

    @abstractmethod
    def collect(self) -> DraftProposal:
        """Wait for the in-flight drafting; after `stop()` it may hold fewer than γ tokens."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the job's draft state."""


class BatchDraft(ABC):
    """A batch's draft rows behind an executor (`Executor.batch_draft`): q's stacked cache and each
    row's draft bookkeeping live there (`hippo.engine.DraftRows`, e.g. in a draft process), in the
    order of the engine's rows. Any failure surfaces as `DraftFailure`; the batch then goes on with
    the target alone."""

    @abstractmethod
    def join(self, job: Job, policy: Any) -> None:
        """Prefill q for `job` on its kept visual tokens (`job.prune()`), as the last row; `policy`:
        the row's draft policy (a sampled row's fork: its own generator), which travels with it."""

    @abstractmethod
    def draft(
        self, bases: list[list[int]], gammas: list[int]
    ) -> tuple[list[DraftProposal], list[list[int]], float, int, list[BaseException | None]]:
        """Row b's chain of `gammas[b]` tokens after `bases[b]` (its tokens after the prompt): the
        proposals, their tokens on the host, q's forward seconds and forwards, and each row's own
        failure (its logits processors, its sampler), or None."""

    @abstractmethod
    def select(self, keep: list[int]) -> None:
        """Keep only rows `keep` (indices, in order)."""

    def target(self, kind: str, fn: Callable[..., T], *args: Any) -> T:
        """p's work ("prefill" or "verify"), as the executor runs it beside this draft."""
        return fn(*args)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Drop the rows (the batch ended)."""


class Executor(Component):
    """Places the draft (a `DraftWorker`) and times the target's work.

    `target_busy` holds the wall-clock [start, end) of each piece of target work, which a worker
    intersects with its own busy intervals to report the draft time hidden behind the target.
    """

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.target_busy: list[tuple[float, float]] = []

    @abstractmethod
    def open(self, job: Job) -> DraftWorker:
        """A worker for this job's draft (inputs, sampling policy, drafter)."""

    def target(self, kind: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one piece of target work in this process; `kind` is "prefill", "extend" (a video
        context's question: its own tokens after the cached prefix) or "verify"."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.target_busy.append((t0, time.perf_counter()))

    def overlaps(self, job: Job) -> bool | str:
        """Whether this executor would run `job`'s draft beside its target (a thread, a process): a
        batch of a parallel schedule then drafts its next block while p verifies this one
        (`hippo.engine`), on a thread or where `batch_draft` puts its rows; "inline": the same
        blocks, drafted in the caller's thread (an executor whose overlap is simulated). Default:
        False, one after the other."""
        return False

    def batch_draft(self, job: Job) -> BatchDraft | None:
        """A place of their own for the draft rows of a batch that `job` starts, beside p (a draft
        process), or None: they live in the engine's process, on a thread beside p. Default: None."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Shut down workers (processes, streams)."""
