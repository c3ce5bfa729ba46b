"""Parallel speculative decoding: `pearl` (PEARL adapted to video) and `hippo` (HIPPO's VPSD).

Both alternate two modes (PEARL's pre-/post-verify; HIPPO's conservative/optimistic), which the
engine's round runs (`hippo.engine`: `Overlapped` for a job alone, its draft thread for a batch):
- conservative: the draft makes x_1 alone; then the target checks x_1 *while* the draft makes the
  block after it. A reject of x_1 discards that block (`hippo` aborts the drafting at once, `pearl`
  waits for it).
- optimistic: the target verifies the block drafted ahead *while* the draft makes the next one. All
  accepted and the target's next token is the next block's first: stay optimistic, the rest of that
  block is verified next. Otherwise go conservative.
`hippo` adds the synchronous draft-target prefill: the draft prefills its pruned input and keeps
drafting while the target is still prefilling; that buffer is the first block ahead.

The attention score needs the target's prefill, but an early draft needs its kept indices before
that prefill ends. `prune` resolves it:
- "late": prune after the target's prefill with the pipeline's scorer (no early start);
- "early": prune once, before the target's language-model prefill, with `early_scorer` (no attention);
- "two_phase" (hippo's default): start with `early_scorer`, then re-prune with the pipeline's scorer
  once the target's prefill is done and re-prefill the draft if the kept set changed.
Executors decide where the draft runs; this module is policy: γ (`batch_gamma`), where q drafts
(`batch_overlap`, `open_drafting`) and how both sides prefill (`_start`).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from hippo import hookimpl
from hippo.cost import AutoGamma, costs_option
from hippo.engine import Overlapped
from hippo.executor import DraftWorker, Executor
from hippo.interfaces import GammaPolicy, RoundInfo, Scheduler, make_config
from hippo.job import DecodeJob
from hippo.registry import lookup
from hippo.validators import gamma_option, positive_int

PRUNE = ("late", "early", "two_phase")


class SpeedRatio(GammaPolicy):
    """`auto_gamma`: γ ≈ p's seconds per verification over q's seconds per draft token, as measured
    while the job runs (`gamma` until both are known), at most `gamma_max`."""

    def __init__(self, gamma: int, gamma_max: int):
        self.first, self.gamma_max = gamma, gamma_max

    def gamma(self, info: RoundInfo) -> int:
        if not info.t_verify or not info.t_draft:
            return self.first
        return max(1, min(self.gamma_max, round(info.t_verify / info.t_draft)))


@attrs.frozen
class ParallelConfig:
    gamma: int | str = attrs.field(default=5, validator=gamma_option)  # "auto": the cost model (hippo.cost)
    auto_gamma: bool = False  # γ ≈ target verify time / draft step time, measured during the run
    gamma_max: int = attrs.field(default=16, validator=positive_int)
    executor: str = "auto"  # the machine decides: hippo.plugins.auto_executor
    executor_options: dict = attrs.field(factory=dict)
    sync_prefill: bool = False
    abort: bool = False
    prune: str = attrs.field(default="late", validator=attrs.validators.in_(PRUNE))
    early_scorer: str | None = None  # None: the selector alone (hippo: holistic without attention)
    early_scorer_options: dict = attrs.field(factory=dict)
    buffer_max: int = attrs.field(default=32, validator=positive_int)  # draft tokens buffered during prefill
    # gamma="auto" on these costs, not measured ones (hippo.cost.fixed_costs)
    costs: dict | None = attrs.field(default=None, validator=costs_option)


class ParallelScheduler(Scheduler):
    Config = ParallelConfig

    def __init__(self, config: ParallelConfig | None = None):
        super().__init__(config)
        cfg = self.config
        self.executor: Executor = lookup("executors", cfg.executor).from_options(**cfg.executor_options)
        auto = cfg.gamma == "auto"
        self.auto = AutoGamma(parallel=True, gamma_max=cfg.gamma_max, costs=cfg.costs) if auto else None
        self.early_scorer = None
        if cfg.early_scorer is not None:
            self.early_scorer = lookup("scorers", cfg.early_scorer).from_options(**cfg.early_scorer_options)

    # ---- γ ------------------------------------------------------------------------------------
    def batch_gamma(self, job: DecodeJob, rows: int) -> int | AutoGamma | SpeedRatio:
        """γ fixed, re-chosen each round by the cost model (`gamma="auto"`), or, with `auto_gamma`,
        from the measured ratio of p's verification to q's draft step (`SpeedRatio`)."""
        cfg = self.config
        if self.auto is not None:
            return self.auto
        return SpeedRatio(cfg.gamma, cfg.gamma_max) if cfg.auto_gamma else cfg.gamma

    # ---- prefill ------------------------------------------------------------------------------
    def _start(self, job: DecodeJob, worker: DraftWorker):
        """Prefill both sides; returns (target session, unverified draft buffer or None)."""
        cfg, ex = self.config, self.executor
        # a question on a video context prefills only its own tokens: an "extend", not a "prefill"
        kind = job.source.kind
        if cfg.prune == "late":
            target = ex.target(kind, job.prefill_target)
            worker.prefill(job.prune())
            return target, None
        job.target_encoded()  # the target's vision encoder: the visual tokens to score
        early = job.select(self.early_scorer)
        worker.prefill(early)
        if cfg.sync_prefill:
            worker.submit(job.prefix(), min(cfg.buffer_max, job.remaining))
        target = ex.target(kind, job.prefill_target)
        buffer = None
        if cfg.sync_prefill:
            worker.stop()
            buffer = worker.collect()
        if cfg.prune == "two_phase":
            late = job.prune()
            if late.shape != early.shape or not torch.equal(late, early):
                worker.prefill(late)
        else:
            job.kept = early
        return target, (buffer if buffer is not None and buffer.size else None)

    # ---- a job alone: its draft behind this schedule's executor, on the engine's round ----------
    def open_drafting(self, job: DecodeJob) -> Overlapped:
        worker = self.executor.open(job)
        return Overlapped(self.executor, worker, lambda: self._start(job, worker), self.config.abort)

    # ---- rows decoded together (`hippo.engine`) ------------------------------------------------
    batches = True

    def batch_overlap(self, job: DecodeJob) -> bool | str:
        """Beside p where this schedule's executor would run the draft beside p for `job` (in a
        batch: on a thread of this process, or where the executor's `batch_draft` puts the rows)."""
        return self.executor.overlaps(job)

    def open_batch_drafting(self, job: DecodeJob) -> Any:
        """The executor's own place for the batch's draft rows (a draft process), or None (a thread)."""
        return self.executor.batch_draft(job)

    def close(self) -> None:
        self.executor.close()


class PearlScheduler(ParallelScheduler):
    """PEARL-video: pre-/post-verify switching; the target prefills first, drafts are never aborted."""

    @classmethod
    def from_options(cls, **options):
        return cls(make_config(ParallelConfig, options, owner=cls.__name__))


class HippoScheduler(ParallelScheduler):
    """HIPPO's VPSD: PEARL + synchronous draft-target prefill + aborting rejected drafts."""

    @classmethod
    def from_options(cls, **options):
        defaults = {
            "sync_prefill": True,
            "abort": True,
            "prune": "two_phase",
            # the early selection cannot read the target's attention yet: temporal + spatial only
            "early_scorer": "holistic",
            "early_scorer_options": {"components": ("temporal", "spatial")},
        }
        return cls(make_config(ParallelConfig, {**defaults, **options}, owner=cls.__name__))


@hookimpl
def hippo_register_schedulers():
    return {"pearl": PearlScheduler, "hippo": HippoScheduler}
