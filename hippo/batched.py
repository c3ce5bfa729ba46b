"""Deprecated: the batch engine is `hippo.engine` (`Engine`: rows join and leave between rounds) and
the stacked caches are `hippo.stacked` (`BatchedCache`). This module re-exports them for one minor
version and warns on import; it goes in 0.3."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from hippo.engine import Engine, can_batch, chain_rewrite, row_sessions
from hippo.stacked import COMPACT_MIN, COMPACT_SHARE, BatchedCache

warnings.warn(
    "hippo.batched is deprecated and goes in 0.3: use hippo.engine.Engine (decode_jobs(pipe, jobs, γ) is "
    "Engine(pipe).run(jobs), γ from the scheduler's batch_gamma) and hippo.stacked.BatchedCache",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["COMPACT_MIN", "COMPACT_SHARE", "BatchedCache", "batch_gamma", "chain_rewrite", "decode_jobs",
           "row_sessions"]  # fmt: skip


def decode_jobs(pipe: Any, jobs: Sequence[Any], gamma: Any = None) -> None:
    """Deprecated: `Engine(pipe).run(jobs)`; γ now comes from the schedule (`Scheduler.batch_gamma`)."""
    Engine(pipe).run(jobs)


def batch_gamma(pipe: Any) -> int | str | None:
    """Deprecated: `hippo.engine.can_batch(pipe)` says whether a pipeline batches; γ is the schedule's
    `batch_gamma`. Returns what it used to: 0, a fixed γ, "auto", or None."""
    if not can_batch(pipe):
        return None
    if not pipe.scheduler.needs_draft:
        return 0
    gamma = getattr(getattr(pipe.scheduler, "config", None), "gamma", "auto")
    return gamma if isinstance(gamma, int) else "auto"
