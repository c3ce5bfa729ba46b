"""`executor="auto"` (the default of `pearl` and `hippo`): where the draft runs, chosen per job from
the machine, the models and the decoding.

- the draft is the target model itself (self-speculation), or fewer than `PROCESS_CORES` cores:
  `inline`, one after the other, each model on all cores;
- sampling: `inline`, one after the other. Beside the target (a process, or a thread on CUDA), how
  far the draft got before an abort depends on timing, and so do the random draws after it: exact in
  law, but a seeded run would not repeat token for token. Choose `process` explicitly to sample in
  parallel;
- greedy, a model on CUDA: `inline`, whose own "auto" overlap puts the draft on a thread and a CUDA
  stream;
- greedy, both models on CPU, c >= `PROCESS_CORES` cores: `process`, the draft on c // 2 threads in
  its own process, the target decoding on as many and prefilling on all c.

Measured on 2 cores (narration pair, 256 tokens, `hippo`, γ auto, holistic top-k 0.1, every output
identical): one after the other on both cores, 1.12-1.24 s per clip (median of 4, two runs);
a draft process with the target's prefill on both cores, 1.38-1.54 s; one core per model
throughout, 1.35-1.59 s. In another script, the draft on a thread did no better than a process
(1.72x against 1.71-1.91x over HF), the target decoding on both cores beside the draft process
(oversubscribed) fell to 1.36x, and lowering the draft process's priority did not help. Here the
draft costs 1/11-1/18 of the target per token, so hiding it saves less than the target loses by
giving up a core in every verification. Whether a draft process pays with 4 or more cores is
not measured here (no such machine); it is the paper's premise, each model on its own device.

Each chosen executor is built once and kept (a draft process is reused by later greedy jobs).
Options given here reach the executor they name (e.g. {"process": {"timeout": 60}}).
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from hippo import hookimpl
from hippo.errors import ConfigError
from hippo.executor import BatchDraft, DraftWorker, Executor
from hippo.job import DecodeJob
from hippo.registry import lookup
from hippo.validators import positive_int

CHOICES = ("inline", "process")  # the executors `auto` may pick
PROCESS_CORES = 4  # the fewest CPU cores on which greedy decoding puts the draft in its own process


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def choose(job: DecodeJob, cores: int) -> tuple[str, dict[str, Any]]:
    """(executor name, options) for this job on `cores` CPU cores (see the module doc)."""
    p = job.pipeline
    target, draft = p.target_adapter.model, p.draft_adapter.model
    if draft is target or cores < PROCESS_CORES or job.policy.do_sample:
        return "inline", {"overlap": "off"}
    if "cuda" in (p.target_adapter.device.type, p.draft_adapter.device.type):
        return "inline", {"overlap": "auto"}
    return "process", {"threads": cores // 2, "prefill_threads": cores}


class AutoExecutor(Executor):
    """Picks `inline` or `process` for each job (see the module doc), then delegates to it."""

    @attrs.frozen
    class Config:
        cores: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
        #: options for a chosen executor, by its name (e.g. {"process": {"timeout": 60}})
        options: dict = attrs.field(factory=dict)

        @options.validator
        def _names(self, _attr, value):
            unknown = sorted(set(value) - set(CHOICES))
            if unknown:
                raise ConfigError(
                    f"auto executor options name {unknown}; it only chooses among {', '.join(CHOICES)}"
                )

    def __init__(self, config=None):
        super().__init__(config)
        self.executors: dict[str, Executor] = {}  # by name, built on first choice
        self.chosen: Executor | None = None  # the current job's

    def overlaps(self, job: DecodeJob) -> bool:
        name, options = choose(job, self.config.cores or usable_cores())
        if name == "process":
            return True
        return lookup("executors", name).from_options(**options).overlaps(job)

    def _choose(self, job: DecodeJob) -> Executor:
        name, options = choose(job, self.config.cores or usable_cores())
        if name not in self.executors:
            options = {**options, **self.config.options.get(name, {})}
            self.executors[name] = lookup("executors", name).from_options(**options)
        return self.executors[name]

    def open(self, job: DecodeJob) -> DraftWorker:
        self.chosen = self._choose(job)
        return self.chosen.open(job)

    def batch_draft(self, job: DecodeJob) -> BatchDraft | None:
        """The chosen executor's place for a batch's draft rows (a draft process on a CPU)."""
        return self._choose(job).batch_draft(job)

    def target(self, kind: str, fn, *args, **kwargs):
        return self.chosen.target(kind, fn, *args, **kwargs)

    @property
    def pid(self) -> int | None:
        """The draft process's id, while one is running."""
        process = self.executors.get("process")
        return None if process is None else process.pid

    def close(self) -> None:
        for ex in self.executors.values():
            ex.close()


@hookimpl
def hippo_register_executors():
    return {"auto": AutoExecutor}
