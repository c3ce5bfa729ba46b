"""The batch check: a part is lossless inside a continuous batch (`hippo.engine.Engine`), with rows
that join mid-flight and rows that are cancelled.

Each example is a greedy harness case (`strategies.cases`: the part's pipeline, γ, keep ratio,
corrupted draft positions, stops) plus 1-3 more rows on the same tiny target (other videos and
prompts, other budgets). Every row joins the engine at a drawn round and some are cancelled a drawn
number of rounds after joining. A row that finishes must be `target.generate`'s answer on that prompt
alone, token for token; a cancelled row must hold a prefix of it. Pipelines whose schedule has no
batched form (`Scheduler.batches` is False) are counted and skipped: `generate` decodes their rows
one after another, which the greedy check already covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from hypothesis import given
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from hippo.errors import HippoError
from hippo.testing import strategies as hs
from hippo.testing.drafters import corrupting_plugin
from hippo.testing.greedy import (
    Build,
    hypothesis_settings,
    make_pipeline,
    part_names,
    raised,
    reproduction,
)
from hippo.testing.reference import eos_stop, first_difference, new_tokens, reference
from hippo.testing.report import LosslessViolation, Report, VacuousCheck


@attrs.define
class BatchResult:
    examples: int = 0  # cases run in a batch
    unbatched: int = 0  # cases whose schedule has no batched form
    joined_live: int = 0  # rows that joined while others were decoding
    cancelled: int = 0
    rounds: int = 0

    def summary(self) -> str:
        return (
            f"{self.examples} batches ({self.joined_live} rows joined mid-flight, {self.cancelled} "
            f"cancelled, {self.rounds} rounds); {self.unbatched} cases without a batched form"
        )


def run_arrivals(
    pipe: Any,
    rows: Sequence[tuple[dict, dict]],  # (inputs, generate's settings) per row
    arrive: Sequence[int],  # the round each row joins at
    cancel: Sequence[int | None],  # rounds after joining that a row is cancelled (None: never)
    seeds: Sequence[int | None] | None = None,
) -> tuple[list[Any], dict[str, int]]:
    """Decode `rows` on one engine with these arrivals and cancellations; returns (the jobs, counts
    of rows that joined while others were live and of rows cancelled, and rounds). The rows that
    arrive at one round are all admitted (`Engine.admit`: their first tokens) before any joins
    (`Engine.join`), as `hippo serve` starts them."""
    engine = pipe.engine()
    seeds = seeds or [None] * len(rows)
    jobs = [pipe.job(x, seed=s, **g) for (x, g), s in zip(rows, seeds)]
    added: dict[int, int] = {}
    seen = {"joined_live": 0, "cancelled": 0, "rounds": 0}
    t = 0
    while len(added) < len(jobs) or engine.live:
        arriving = [i for i in range(len(jobs)) if i not in added and arrive[i] <= t]
        admitted = []
        for i in arriving:  # as `hippo serve` starts them: every first token, then every join
            seen["joined_live"] += bool(engine.live)
            if engine.admit(jobs[i]):
                admitted.append(jobs[i])
            added[i] = t
        for job in admitted:
            engine.join(job)
        for i, job in enumerate(jobs):
            if i in added and cancel[i] is not None and t == added[i] + cancel[i] and engine.cancel(job):
                seen["cancelled"] += 1
        engine.step()
        t += 1
    seen["rounds"] = engine.rounds
    return jobs, seen


def assert_batch_lossless(
    build: Build,
    *,
    adapters: Sequence[str] | str | None = None,
    examples: int | None = None,
    seed: int | None = None,
    shrink: bool = True,
    require: bool = True,
    executors: Sequence[str] = ("inline",),
    draws: dict[str, st.SearchStrategy] | None = None,
) -> BatchResult:
    """Check `build(case)`'s pipeline inside a continuous batch (see the module doc). Raises
    `LosslessViolation` with the counterexample, or `VacuousCheck` (with `require`) when no row
    ever joined mid-flight or was cancelled although some case batched. `executors` and `draws` go
    to `strategies.cases` ("process": a parallel batch's draft rows in a draft process)."""
    result = BatchResult()

    def check(case: Any, data: st.DataObject) -> None:
        pipe, owned = make_pipeline(build, case)
        try:
            if not pipe.can_batch():
                result.unbatched += 1
                return
            target = case.target
            gen = eos_stop(target, case.inputs, case.generation(), case.eos_pick)[0]
            rows = [(case.inputs, gen)]
            for i in range(data.draw(st.integers(1, 3), label="more rows")):
                prompt = data.draw(hs.prompts(case.adapter, target), label=f"row {i + 1}")
                budget = data.draw(hs.max_new_tokens, label=f"max_new_tokens {i + 1}")
                rows.append((prompt.inputs, {"do_sample": False, "max_new_tokens": budget}))
            arrive = [data.draw(st.integers(0, 3), label=f"row {i} joins at round") for i in range(len(rows))]
            cancel = [
                data.draw(st.none() | st.integers(0, 3), label=f"row {i} cancelled after")
                for i in range(len(rows))
            ]
            where = f"{case.short()}; rows {len(rows)}, joins at {arrive}, cancelled after {cancel}"
            try:
                jobs, seen = run_arrivals(pipe, rows, arrive, cancel, [case.seed] + [None] * (len(rows) - 1))
            except HippoError:
                raise
            except Exception as exc:
                who = "the batch engine or a part of the pipeline"
                raise raised(exc, "batched", build, case, pipe, where, who) from exc
            result.examples += 1
            for key, n in seen.items():
                setattr(result, key, getattr(result, key) + n)
            for i, (job, (inputs, g)) in enumerate(zip(jobs, rows)):
                L = inputs["input_ids"].shape[1]
                want = new_tokens(reference(target, inputs, **g), L)
                cancelled = "cancelled" in job.stats.notes
                expected = want[: len(job.tokens)] if cancelled else want
                if job.tokens != expected:
                    pos = first_difference(job.tokens, expected)
                    pos = 0 if pos is None else pos
                    raise LosslessViolation(
                        Report(
                            check="batched",
                            summary=f"row {i} of a batch is not target.generate's answer on its prompt alone"
                            + (" (cancelled: not a prefix of it)" if cancelled else ""),
                            case=where,
                            parts=part_names(pipe),
                            position=pos,
                            got=job.tokens[pos] if pos < len(job.tokens) else None,
                            want=want[pos] if pos < len(want) else None,
                            got_tokens=list(job.tokens),
                            want_tokens=want,
                            reproduce=reproduction(build, case),
                            counterexample=case,
                        )
                    )
        finally:
            if owned:
                pipe.close()

    check = hypothesis_settings(examples, seed, shrink)(
        given(case=hs.cases(adapters, executors=executors, draws=draws), data=st.data())(check)
    )
    if seed is not None:
        check = hypothesis_seed(seed)(check)
    with corrupting_plugin():
        check()
    if require and result.examples and not (result.joined_live and result.cancelled):
        raise VacuousCheck(f"no row joined mid-flight or none was cancelled: {result.summary()}")
    return result
