"""The sequential schedules: the target alone, and vanilla (serial) speculative decoding.

Both are policy only (`batch_gamma`): the engine (`hippo.engine`) runs their rounds, for one job alone
(a batch of one on its own sessions and drafter) and for rows decoded together."""

from __future__ import annotations

import attrs

from hippo import hookimpl
from hippo.cost import AutoGamma, costs_option
from hippo.interfaces import Scheduler
from hippo.job import DecodeJob
from hippo.validators import gamma_option


class AutoregressiveScheduler(Scheduler):
    """The target alone, one token per forward: the baseline every speedup is measured against."""

    needs_draft = False
    batches = True

    def batch_gamma(self, job: DecodeJob, rows: int) -> int:
        return 0


class SerialScheduler(Scheduler):
    """Draft γ tokens, verify them in one target pass, crop both caches to the accepted length.

    `gamma="auto"` chooses each round's γ with the cost model (`hippo.cost`), γ = 0 included: a
    step of the target alone while drafting is expected to lose. `costs` fixes the model's costs
    instead of measuring them ({"verify": {k: seconds}, "draft": seconds per draft token}).
    """

    @attrs.frozen
    class Config:
        gamma: int | str = attrs.field(default=5, validator=gamma_option)
        costs: dict | None = attrs.field(default=None, validator=costs_option)

    def __init__(self, config=None):
        super().__init__(config)
        cfg = self.config
        self.auto = AutoGamma(parallel=False, costs=cfg.costs) if cfg.gamma == "auto" else None

    batches = True

    def batch_gamma(self, job: DecodeJob, rows: int) -> int | AutoGamma:
        """A batch drafts as one job does: γ fixed, or re-chosen each round (for all live rows)."""
        return self.config.gamma if self.auto is None else self.auto


@hookimpl
def hippo_register_schedulers():
    return {"autoregressive": AutoregressiveScheduler, "serial": SerialScheduler}
