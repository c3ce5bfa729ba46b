"""The event record of one `generate` call: what each model did, and when (a run's timeline).

Opt-in: `Pipeline.generate(..., timeline=True)` gives the job an `EventLog`; without it the job's
`events` is None, each call site pays one `is None` test, and no event is ever made.

Two lanes, p = "target" and q = "draft". Kinds:
    target: "vision" (vision encoding), "prefill", "prune" (scoring + selection), "verify" (one
            target pass over a draft), "step" (a plain autoregressive step: the first token, or
            the target alone after a draft failure)
    draft:  "vision" (the draft's own vision encoding), "prefill", "draft" (one propose call),
            "buffer" (drafting before the target's first token: hippo's synchronous prefill)

Positions: a draft event drafts at sequence positions [pos, pos + depth); a verify event checks
[pos, pos + depth) and accepts the first `accepted`. `label` matches them after the run (each
verified position came from the latest drafting of it that ended before the verify began) and
books on each draft event how many of its positions were accepted and rejected; the rest were
never verified (discarded after an earlier rejection, or cut short: `stopped`, an aborted draft).

Clock: `time.perf_counter`. On Linux it is clock_gettime(CLOCK_MONOTONIC), one system-wide clock,
so a draft process's stamps compare with the parent's as they are (macOS's mach_absolute_time and
Windows' QueryPerformanceCounter are system-wide too). `label` makes them seconds since the call
began.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

F = TypeVar("F", bound=Callable[..., Any])

LANES = ("target", "draft")


def booked(lane: str, kind: str | None, seconds: str) -> Callable[[F], F]:
    """Book every call of a job's method: its wall seconds are added to `job.stats.<seconds>`, and
    with a timeline, an event (`lane`, `kind`) is recorded (`kind` None: the method books its own)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def timed(job: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(job, *args, **kwargs)
            setattr(job.stats, seconds, getattr(job.stats, seconds) + time.perf_counter() - t0)
            if kind is not None:
                job.observe(lane, kind, t0)
            return out

        return timed  # type: ignore[return-value]

    return wrap


@attrs.frozen
class Event:
    """One piece of work of one model: [start, end) in seconds, with what it did."""

    lane: str  # "target" | "draft"
    kind: str  # see the module docstring
    start: float
    end: float
    pos: int = -1  # first sequence position drafted / verified (-1: none)
    n: int = 0  # draft tokens made (draft) or in the verified proposal (verify)
    depth: int = 0  # positions covered: n for a chain, the tree's depth for a tree
    gamma: int = 0  # draft tokens asked for (draft events)
    accepted: int = 0  # positions accepted (verify; draft events once labelled)
    rejected: int = 0  # positions verified and not accepted (verify; draft events once labelled)
    emitted: int = 0  # tokens emitted (verify, step)
    stopped: bool = False  # the drafting was cut short by a stop request (aborted)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def unverified(self) -> int:
        """Draft positions the target never checked (thrown away or never drafted)."""
        return max(0, self.depth - self.accepted - self.rejected)

    @property
    def aborted(self) -> bool:
        """A drafting stopped early because its tokens were no longer wanted."""
        return self.stopped and self.kind == "draft"


class EventLog:
    """The events of one job, appended from the scheduler's thread and a draft thread."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def add(self, lane: str, kind: str, start: float, end: float | None = None, **details) -> None:
        """Book [start, end) (end: now)."""
        self.events.append(Event(lane, kind, start, time.perf_counter() if end is None else end, **details))


def label(events: list[Event], prompt_length: int, origin: float = 0.0) -> list[Event]:
    """The events in time order, times relative to `origin`, each draft event's positions booked
    as accepted / rejected by the verify events that checked them, and drafts made before the first
    token (at position `prompt_length`) renamed "buffer"."""
    events = sorted(events, key=lambda e: (e.start, e.end))
    drafts = [i for i, e in enumerate(events) if e.lane == "draft" and e.kind == "draft"]
    booked = {i: [0, 0] for i in drafts}  # index -> [accepted, rejected]
    for v in events:
        if v.lane != "target" or v.kind != "verify":
            continue
        for p in range(v.pos, v.pos + v.depth):
            src = None  # the latest drafting of position p that ended before this verify began
            for i in drafts:
                d = events[i]
                if d.start > v.start:
                    break
                if (
                    d.end <= v.start
                    and d.pos <= p < d.pos + d.depth
                    and (src is None or d.end >= events[src].end)
                ):
                    src = i
            if src is not None:
                booked[src][0 if p < v.pos + v.accepted else 1] += 1
    out = []
    for i, e in enumerate(events):
        changes: dict = {"start": e.start - origin, "end": e.end - origin}
        if i in booked:
            changes.update(accepted=booked[i][0], rejected=booked[i][1])
            if e.pos == prompt_length:
                changes["kind"] = "buffer"
        out.append(attrs.evolve(e, **changes))
    return out
