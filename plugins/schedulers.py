"""The sequential schedules: the target alone, and vanilla (serial) speculative decoding."""

from __future__ import annotations

import attrs

from hippo import hookimpl
from hippo.config import positive_int
from hippo.interfaces import Scheduler
from hippo.job import DecodeJob


class AutoregressiveScheduler(Scheduler):
    """The target alone, one token per forward: the baseline every speedup is measured against."""

    needs_draft = False

    def run(self, job: DecodeJob) -> None:
        target = job.prefill_target()
        while not job.done:
            job.target_step(target)


class SerialScheduler(Scheduler):
    """Draft γ tokens, verify them in one target pass, crop both caches to the accepted length."""

    @attrs.frozen
    class Config:
        gamma: int = attrs.field(default=5, validator=positive_int)

    def run(self, job: DecodeJob) -> None:
        target = job.prefill_target()
        job.first_token(target)
        if job.done:
            return
        draft = job.draft_side()
        while not job.done:
            gamma = min(self.config.gamma, job.remaining - 1)
            job.verify_round(target, draft.propose(job.prefix(), gamma))


@hookimpl
def hippo_register_schedulers():
    return {"autoregressive": AutoregressiveScheduler, "serial": SerialScheduler}
