"""Parallel speculative decoding: `pearl` (PEARL adapted to video) and `hippo` (HIPPO's VPSD).

Both alternate two modes (PEARL's pre-/post-verify; HIPPO's conservative/optimistic):
- conservative: the draft makes x_1 alone; then the target checks x_1 *while* the draft makes
  x_2..x_γ. A reject of x_1 discards them (`hippo` aborts the drafting at once, `pearl` waits for it).
- optimistic: the target verifies the unverified batch x_1..x_γ *while* the draft makes the next
  batch after it. All accepted: stay optimistic, and p_γ checks the next batch's first token
  (no bonus token is drawn). A reject rolls both back and goes conservative.
`hippo` adds the synchronous draft-target prefill: the draft prefills its pruned input and keeps
drafting while the target is still prefilling; the target then verifies that buffer first.

The attention score needs the target's prefill, but an early draft needs its kept indices before
that prefill ends. `prune` resolves it:
- "late": prune after the target's prefill with the pipeline's scorer (no early start);
- "early": prune once, before the target's language-model prefill, with `early_scorer` (no attention);
- "two_phase" (hippo's default): start with `early_scorer`, then re-prune with the pipeline's scorer
  once the target's prefill is done and re-prefill the draft if the kept set changed.
Executors decide where the draft runs; this module only decides what to ask and when.
"""

from __future__ import annotations

import logging

import attrs
import torch

from hippo import hookimpl
from hippo.cost import GAMMA_START, AutoGamma, GammaPlan, costs_option
from hippo.executor import DraftFailure, DraftWorker, Executor
from hippo.interfaces import Scheduler, make_config
from hippo.job import DecodeJob
from hippo.proposal import DraftProposal, Verdict
from hippo.registry import lookup
from hippo.validators import gamma_option, positive_int

log = logging.getLogger("hippo")

PRUNE = ("late", "early", "two_phase")


def _cat(prefix: torch.Tensor, prop: DraftProposal) -> torch.Tensor:  # -> [T + s]
    """The prefix followed by the proposal's spine: where the draft continues during verification."""
    return torch.cat([prefix, prop.spine_tokens().cpu()])


def _continues(job: DecodeJob, verdict: Verdict) -> bool:
    """The draft's continuation is usable: the round accepted the whole chain it continues (so it
    drew no bonus token; the target's last logits check the continuation) and decoding goes on."""
    return verdict.next_token is None and not job.done


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
    def _gamma(self, job: DecodeJob, worker: DraftWorker, target, plan: GammaPlan | None) -> int:
        """This round's γ; 0 (only from `plan`, under gamma="auto") = a step of the target alone."""
        cfg = self.config
        gamma = cfg.gamma
        # seconds per draft token the worker made, discarded ones included (a rejected round's
        # continuation, an aborted drafting): per *verified* token would count their time but not them
        drafted = worker.tokens_drafted
        per_draft = worker.seconds_decode / drafted if drafted and worker.seconds_decode > 0 else None
        if plan is not None:
            # p's steps are timed against q's live seconds only where both are on the real clock
            live = None if worker.virtual else target
            gamma = plan.next(job.stats, per_draft, live)
            if gamma == 0:
                return 0
        elif cfg.auto_gamma and per_draft and target.forwards:
            per_verify = target.seconds_decode / target.forwards
            gamma = max(1, min(cfg.gamma_max, round(per_verify / per_draft)))
        return max(1, min(gamma, job.remaining))

    def _verify_batch(self, job: DecodeJob, target, batch: DraftProposal, gamma: int) -> Verdict:
        """Verify an unverified batch without a bonus token; under `gamma="auto"`, in chunks of this
        round's γ, so a long buffer that is rejected early costs a short pass, not one long one."""
        size = gamma if self.auto is not None else batch.size
        for chunk in batch.chunks(max(1, size)):
            verdict = self.executor.target("verify", job.verify_round, target, chunk, bonus=False)
            if not _continues(job, verdict):
                break
        return verdict

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

    # ---- decoding -----------------------------------------------------------------------------
    def _discard(self, worker: DraftWorker) -> None:
        if self.config.abort:
            worker.stop()
        worker.collect()

    def run(self, job: DecodeJob) -> None:
        ex = self.executor
        worker = ex.open(job)
        target = plan = None
        try:
            target, unverified = self._start(job, worker)
            if self.auto is not None:
                self.auto.calibrate(target, job.prefix())  # once per pipeline
                # q's time counts beside p's only where q works while p does (a thread or a process)
                plan = self.auto.plan(parallel=worker.overlapped, prior=job.alpha_prior)
            if unverified is None:
                job.first_token(target)
            while not job.done:
                gamma = self._gamma(job, worker, target, plan)
                prefix = job.prefix()
                if gamma == 0:  # the target alone; the draft is idle and catches up at its next submit
                    if unverified is not None:  # drafted already: verify it, drafting nothing beside
                        self._verify_batch(job, target, unverified, GAMMA_START)
                        unverified = None
                    else:
                        ex.target("verify", job.target_step, target)
                elif unverified is None:  # conservative / pre-verify
                    worker.submit(prefix, 1)
                    x1 = worker.collect()
                    if gamma > 1:
                        worker.submit(_cat(prefix, x1), gamma - 1)
                    verdict = ex.target("verify", job.verify_round, target, x1, bonus=False)
                    if gamma > 1:
                        if _continues(job, verdict):
                            rest = worker.collect()
                            unverified = rest if rest.size else None
                        else:
                            self._discard(worker)
                else:  # optimistic / post-verify
                    worker.submit(_cat(prefix, unverified), gamma)
                    verdict = self._verify_batch(job, target, unverified, gamma)
                    if _continues(job, verdict):
                        nxt = worker.collect()
                        unverified = nxt if nxt.size else None
                    else:
                        self._discard(worker)
                        unverified = None
        except DraftFailure as exc:
            log.warning("hippo: %s; finishing with the target alone (output unchanged)", exc)
            job.stats.fallback = True
            job.stats.notes.append(f"draft failed: {exc}")
            if target is None:
                target = job.prefill_target()
            while not job.done:
                job.target_step(target)
        finally:
            if plan is not None:
                plan.book(job.stats)
            job.stats.seconds_draft_prefill += worker.seconds_prefill
            job.stats.seconds_draft_decode += worker.seconds_decode
            job.stats.seconds_draft_overlapped += worker.seconds_overlapped
            worker.close()

    # ---- rows decoded together (`hippo.engine`) ------------------------------------------------
    batches = True

    def batch_gamma(self, job: DecodeJob, rows: int) -> int | AutoGamma:
        """A batch drafts as one job does: γ fixed, or re-chosen each round for all live rows."""
        return self.config.gamma if self.auto is None else self.auto

    def batch_overlap(self, job: DecodeJob) -> bool | str:
        """Beside p where this schedule's executor would run the draft beside p for `job` (on a
        thread of this process in a batch: the batch's draft rows live here)."""
        return self.executor.overlaps(job)

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
