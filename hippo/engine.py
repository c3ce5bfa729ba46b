"""The batch engine: live rows decoded together, one speculative round per `step()`, with rows that
join and leave between rounds (continuous batching).

Notation: p = target, q = draft, γ = draft length, B = live rows, V = vocabulary.

A row is a job (`hippo.interfaces.Job`) that the pipeline builds as `Pipeline.generate` builds it,
but with plain sessions. `add(job)` prefills it on its own exactly as `generate` prefills it (p on
the whole prompt or a video context's cached prefix, q on the visual tokens the pipeline's scorer
and selector keep for that row) and emits its first token; it then joins the rows' stacked caches
(`hippo.stacked.BatchedCache`) and takes part from the next round on. `step()` runs one round for
all live rows: q drafts up to γ tokens per row in batched forwards, p verifies every row's block
in one forward, and each row settles its round as batch 1 does (`hippo.accept.settle`: its own
`TokenPolicy`, its verifier, the job's EOS and budget rules). A row that finishes, or that
`cancel` removes, leaves at once and is finished (`Job.finish`).

So each row's answer is its own batch-1 answer whatever else shares its batch: `target.generate`'s
when greedy, and the same draws from the row's generator as batch 1 with the same γ when sampling.

The parallel schedules (`pearl`, `hippo`: `Scheduler.batch_overlap`) draft beside the target: while
p verifies a round's blocks, q drafts each row's next block on a thread (`_Beside`), continuing the
block as if p accepted all of it. Where p did, and its next token is q's first guess, the rest is the
row's next block, verified at once (PEARL's post-verify); otherwise q drafts one token before the
next verification and the rest beside it (pre-verify). The emitted tokens are p's own either way; a
sampled row's draft draws from a fork of its generator, and its next block is a draw from q given
the tokens emitted, so rejection sampling stays exact.
γ comes from the pipeline's schedule (`Scheduler.batch_gamma`): a fixed γ, 0 (the target alone),
a `hippo.cost.AutoGamma` that re-chooses one γ for all live rows each round, or the schedule's own
`GammaPolicy`, asked each round. A sampled row keeps
one fixed γ (`sampled_gamma`) through every round, so a seeded sample does not depend on the rows
it shares the batch with (greedy rows are exact at any γ).

`Pipeline.generate_batch`, `Pipeline.map`, `hippo batch` and `hippo serve` decode on this loop, and
so does `generate` with every built-in schedule: `decode_alone` runs one job as a batch of one that
nothing joins, on the same round, its own sessions (packed or compiled) standing as one-row stacks
(`hippo.stacked.SessionRow`). A drafter without a batched chain form (a token tree, a third-party
drafter) drafts there with its own `propose`, and a tree is scored in one masked pass of the row's
session. `pearl` and `hippo` give a job alone their executor's draft worker as its producer
(`Overlapped`: a thread, a process, a simulated clock), with their prefill (the synchronous draft
buffer, early and two-phase pruning) and abort.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from hippo import interfaces
from hippo.accept import commit, decide_reading, process_rows
from hippo.cost import GAMMA_START, AutoGamma, GammaPlan
from hippo.errors import UnsupportedError
from hippo.executor import BatchDraft, DraftFailure
from hippo.interfaces import Job, RoundInfo, catch_up, prefilling
from hippo.packed import MAX_ROWS, PackedLinears
from hippo.proposal import DraftProposal
from hippo.session import KVSession, PackedSessions
from hippo.stacked import BatchedCache, SessionRow

log = logging.getLogger("hippo")


class _RowPrefill:
    """A batch row's session kind: its prefill runs as the role's kind runs it (on the packed weights:
    `PackedSessions.prefilling`), and its prefilled session stays a plain `KVSession`, which the batch
    stacks into its own cache (`BatchedCache`, packed by `_packing`)."""

    def __init__(self, kind: Any):
        self.kind = kind

    def prefilling(self, model: torch.nn.Module) -> Any:
        return prefilling(self.kind, model)

    def open(self, session: Any, new_tokens: int) -> Any:
        return session


def row_sessions(pipe: Any) -> dict[str, Any]:
    """The session kinds of a batch's rows, per role (the parts its jobs are built with)."""
    return {role: None if kind is None else _RowPrefill(kind) for role, kind in pipe.sessions.items()}


def _packing(pipe: Any, role: str, model: torch.nn.Module) -> tuple[PackedLinears | None, int]:
    return _packed(pipe.sessions.get(role), model)


def _packed(kind: Any, model: torch.nn.Module) -> tuple[PackedLinears | None, int]:
    """How a role's rows are stacked: on its packed weights where its sessions are packed."""
    kind = kind.kind if isinstance(kind, _RowPrefill) else kind
    if isinstance(kind, PackedSessions):
        return PackedLinears.of(model), kind.max_rows
    return None, MAX_ROWS


def chain_rewrite(drafter: Any) -> Callable[[DraftProposal, int], DraftProposal] | None:
    """How `drafter` drafts in a batch, or None when it cannot: each row's chain is drawn token by
    token from q, as the registered `chain` drafter draws it, then passed through the returned
    function with q's vocabulary size. A drafter with `plain_chains` (the `chain` drafter) changes
    nothing; another takes part by defining `rewrite_chain(proposal, vocab) -> DraftProposal` (or
    None: no batched form).
    """
    rewrite = getattr(drafter, "rewrite_chain", None)
    if rewrite is not None:
        return rewrite
    if getattr(drafter, "plain_chains", False):
        return _unchanged
    return None


def _unchanged(proposal: DraftProposal, vocab: int) -> DraftProposal:
    return proposal


def can_batch(pipe: Any) -> bool:
    """Whether the pipeline's schedule decodes rows together (`Scheduler.batches`), with a drafter
    that has a batched form where the schedule drafts."""
    scheduler = pipe.scheduler
    if not scheduler.batches:
        return False
    return not scheduler.needs_draft or chain_rewrite(pipe.drafter) is not None


class _Row:
    """One live row: its job, the tokens its draft consumed after the prompt, its decode seconds."""

    def __init__(self, job: Job, gamma: int | None, side: Any = None):
        self.job = job
        self.side = side  # its own `DraftSide`, where its drafter drafts it (not batched)
        #: the policy its draft tokens are drawn with: the job's, or beside p a fork of it (its own
        #: generator, so the two threads never share one)
        self.draft_policy = job.policy
        #: beside p: its next block, drafted while p verified the last one, and its tokens on the
        #: host (None: none usable)
        self.ahead: tuple[DraftProposal, list[int]] | None = None
        self.gamma = gamma  # a fixed γ for every round (sampled rows), or None: the batch's
        self.draft_generated: list[int] = []
        self.unread_fed = 0  # tokens of this round's chain, still on the device, that q consumed
        self.seconds_target = 0.0
        self.seconds_draft = 0.0
        self.target_steps = 0  # batched steps of the target alone (γ = 0) while this row was live
        self.batch_sizes: list[int] = []  # live rows in each round it took part in
        self.error: BaseException | None = None  # what failed in this row's own work (it then leaves)


class _DraftRow:
    """A batch row as its draft sees it, apart from the engine (`DraftRows`): what `_draft` reads of
    a row (its prompt, its draft policy, what q consumed). It stands as its own `job`."""

    def __init__(self, prompt_ids: torch.Tensor, policy: Any):  # prompt_ids [T0]
        self.job, self.prompt_ids, self.draft_policy = self, prompt_ids, policy
        self.draft_generated: list[int] = []
        self.unread_fed = 0
        self.error: BaseException | None = None


class DraftRows:
    """A batch's draft rows held apart from its engine (in a draft process: `hippo.executor.BatchDraft`):
    q's stacked cache and each row's draft bookkeeping, drafted by the same `_draft` as the engine's
    own rows, its chains always read (they leave this process)."""

    def __init__(self, drafter: Any, kind: Any, model: torch.nn.Module):
        self.rewrite = chain_rewrite(drafter) or _unchanged
        self.packing = _packed(kind, model)
        self.cache: BatchedCache | None = None
        self.rows: list[_DraftRow] = []

    def join(self, session: KVSession, prompt_ids: torch.Tensor, policy: Any) -> None:
        """Stack a row's prefilled session (closed: its cache is copied) as the last row."""
        if self.cache is None:
            self.cache = BatchedCache([session], *self.packing)
        else:
            self.cache.join([session])
        session.close()
        self.rows.append(_DraftRow(prompt_ids, policy))

    def select(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None
        else:
            self.cache.select(keep)
            self.cache.maybe_compact()

    def draft(
        self, bases: list[list[int]], gammas: list[int]
    ) -> tuple[list[DraftProposal], list[list[int]], float, int, list[BaseException | None]]:
        """`BatchDraft.draft`: each row's chain after `bases[b]`, its forward seconds and forwards."""
        cache, rows = self.cache, self.rows
        t0, f0 = cache.seconds, cache.forwards
        policies = [row.draft_policy for row in rows]
        drafted, chains = _draft(cache, rows, gammas, self.rewrite, bases, policies)
        errors = [row.error for row in rows]
        for row in rows:
            row.error = None  # the engine's row leaves with it
        return drafted, chains, cache.seconds - t0, cache.forwards - f0, errors


class _DraftClock:
    """Seconds per batched draft forward, per batch size B, in this engine."""

    def __init__(self) -> None:
        self.by_rows: dict[int, tuple[float, int]] = {}

    def add(self, rows: int, seconds: float, forwards: int) -> None:
        s, n = self.by_rows.get(rows, (0.0, 0))
        self.by_rows[rows] = (s + seconds, n + forwards)

    def per_forward(self, rows: int) -> float | None:
        """At B = `rows`, or at the nearest B seen (None before the first draft step)."""
        seen = [b for b, (_, n) in self.by_rows.items() if n]
        if not seen:
            return None
        s, n = self.by_rows[min(seen, key=lambda b: (abs(b - rows), b))]
        return s / n


class Engine:
    """The one decode loop of a pipeline's rows (see the module doc).

    `add(job)` prefills a job and lets it join the live rows (`admit(job)`, p's prefill and the
    first token, then `join(job)`, q's prefill and the join, for a caller that admits several
    jobs before they join); `step()` runs one round for all of
    them and returns the jobs that finished in it; `cancel(job)` removes a live row. `run(jobs)`
    adds them all and steps until none is live. `sampled_gamma`: the fixed γ of sampled rows
    (default: the schedule's γ where it is fixed, else `hippo.cost.GAMMA_START`). `scheduler`: the
    schedule asked how the batch drafts and told when a row is done (default: the pipeline's).
    `own_sessions`: one job that nothing joins, on its own sessions and drafter (`decode_alone`),
    which the caller finishes; the round is the same. `worker`: that job's draft behind its
    executor's `DraftWorker` (`Overlapped`: the parallel schedules), not in this engine's caches.
    """

    def __init__(
        self,
        pipe: Any,
        sampled_gamma: int | None = None,
        scheduler: Any = None,
        own_sessions: bool = False,
        worker: Overlapped | None = None,
    ):
        if not own_sessions and not can_batch(pipe):
            name = pipe.names.get("scheduler", type(pipe.scheduler).__name__)
            raise UnsupportedError(
                f"scheduler {name!r} with drafter {type(pipe.drafter).__name__} has no batched form: "
                "rows decoded together draft chains (the 'chain' drafter, or one with `rewrite_chain`), "
                "since a token tree's nodes would each need their own mask in the rows' shared cache; "
                "use the 'chain' drafter, a schedule whose `batches` is True ('auto', 'serial', "
                "'pearl', 'hippo', 'autoregressive'), or decode one request at a time"
            )
        self.pipe = pipe
        self.scheduler = pipe.scheduler if scheduler is None else scheduler
        self.sampled_gamma = sampled_gamma
        self.own_sessions = own_sessions or worker is not None
        #: a job alone whose draft runs behind its executor (`Overlapped`); None after it failed
        self.worker = worker
        self.rows: list[_Row] = []
        self.target: BatchedCache | SessionRow | None = None
        self.draft: BatchedCache | SessionRow | None = None
        self.gamma: int | AutoGamma | None = None  # the schedule's form for the batch now live
        self.plan: GammaPlan | None = None
        #: how the rows' chains are drafted in a batch (`chain_rewrite`); None: each row's drafter
        #: drafts it on its own session (a job on its own sessions only)
        self.rewrite: Callable[[DraftProposal, int], DraftProposal] | None = None
        self.clock = _DraftClock()
        #: q drafts each row's next block beside p (the parallel schedules: `Scheduler.batch_overlap`)
        self.overlap = False
        self._beside: _Beside | None = None  # its thread, made once
        #: beside p, the batch's draft rows behind the executor (`BatchDraft`: a draft process);
        #: None: in this engine's own caches
        self.remote: BatchDraft | None = None
        self.rounds = 0
        #: rows the batch is expected to hold when it starts (`Scheduler.batch_gamma` is told)
        self.expected_rows = 1
        self._plan_record: dict = {}  # the schedule's record of its choice, put on every row
        self.seconds_prefill = 0.0  # seconds `add` spent prefilling (the live rows waited meanwhile)
        #: jobs `admit`ted, not yet `join`ed: p's prefilled session and q's early draft of each
        self._admitted: dict[Job, tuple[Any, DraftProposal | None]] = {}

    # ---- rows joining and leaving -------------------------------------------------------------------
    @property
    def live(self) -> list[Job]:
        return [row.job for row in self.rows]

    def add(self, job: Job) -> bool:
        """Prefill `job` as `generate` does and emit its first token; it joins the live rows (True),
        or is finished at once when that token ended it (False). `admit` then `join`."""
        return self.admit(job) and self.join(job)

    def admit(self, job: Job) -> bool:
        """The first half of `add`: p's prefill and the job's first token (False: that token ended it,
        and the job is finished). The row joins the live rows with `join` (q's prefill), which must
        come before the next `step`: a server admits the requests that arrive together, so that
        each one's first token waits for the others' p prefills only, then joins them all."""
        t0 = time.perf_counter()
        try:
            if not self.rows and not self._admitted:  # a new batch: the schedule says how it drafts
                self._start(job)
            for key, value in self._plan_record.items():  # its choice, on every row
                job.stats.plan.setdefault(key, value)
            buffer = None
            if self.worker is not None:  # both sides' prefills, as its schedule arranges them
                try:
                    target, buffer = self.worker.prefill()
                except DraftFailure as exc:
                    self._draft_failed(exc, [job])
                    target = job.prefill_target()  # (once: a job keeps its prefilled session)
            elif self.remote is not None:  # as its executor runs p beside the draft process
                target = self.remote.target("prefill", job.prefill_target)
            else:
                target = job.prefill_target()
            job.first_token(target)
            if job.done:
                if self.own_sessions:  # as a round never taken: nothing to book
                    self._unplan()
                else:
                    self._finish(_Row(job, None))
                return False
            if self.drafting and self.worker is None:
                # the scorer reads what it observed of p's prefill now: the next job's replaces it
                job.prune()
        except BaseException:
            self._failed(job)
            raise
        finally:
            self.seconds_prefill += time.perf_counter() - t0
        self._admitted[job] = (target, buffer)
        return True

    def join(self, job: Job) -> bool:
        """The second half of `add`: q's prefill (where this engine drafts itself), and the admitted
        `job` joins the live rows. Returns True."""
        target, buffer = self._admitted.pop(job)
        t0 = time.perf_counter()
        try:
            draft, policy = None, job.policy
            if self.overlap and job.policy.do_sample:  # q draws on its own thread: its own generator
                policy = job.policy.fork()
            if self.drafting and self.worker is None:
                if self.remote is None:
                    draft = job.prefill_draft()
                else:  # q's prefill and its row there, in the executor's own place
                    try:
                        self.remote.join(job, policy)
                    except DraftFailure as exc:
                        self._draft_failed(exc)
        except BaseException:
            self._failed(job)
            raise
        finally:
            self.seconds_prefill += time.perf_counter() - t0
        self._join(job, target, draft, policy)
        if buffer is not None:
            # drafted while p prefilled (HIPPO's synchronous prefill): where p's first token was q's
            # first guess, the rest is q's draft after it, verified in the first round
            self.rows[-1].ahead = _after(buffer, buffer.tokens.tolist(), job.tokens[0])
        return True

    def _failed(self, job: Job) -> None:
        """`job` failed in `admit` or `join`: it is finished (unless its caller finishes it), and a
        batch that never held a row forgets its plan."""
        if not self.own_sessions:
            job.finish()
        self._unplan()

    def _unplan(self) -> None:
        if not self.rows and not self._admitted:
            self.gamma = self.plan = None

    def _start(self, job: Job) -> None:
        self._close_remote()  # (a batch that never held a row)
        self.gamma = self.scheduler.batch_gamma(job, max(self.expected_rows, 1))
        self._plan_record = dict(job.stats.plan)
        self.plan = None
        mode = self.drafting and (self.worker is not None or self.scheduler.batch_overlap(job))
        self.overlap = bool(mode)
        if isinstance(self.gamma, AutoGamma):
            # behind a worker, q's time counts beside p's only where it works while p does
            parallel = self.overlap if self.worker is None else self.worker.worker.overlapped
            self.plan = self.gamma.plan(parallel=parallel, prior=getattr(job, "alpha_prior", None))
        self.rewrite = chain_rewrite(self.pipe.drafter) if self.drafting else None
        if self.worker is not None:
            return
        if self.overlap and (self._beside is None or self._beside.threaded != (mode != "inline")):
            self._beside = _Beside(self.pipe.draft_adapter.device, threaded=mode != "inline")
        if self.overlap and mode != "inline" and not self.own_sessions:
            try:
                self.remote = self.scheduler.open_batch_drafting(job)  # None: its rows live here
            except DraftFailure as exc:
                self._draft_failed(exc, [job])

    def _close_remote(self) -> None:
        if self.remote is not None:
            remote, self.remote = self.remote, None
            remote.close()

    @property
    def drafting(self) -> bool:
        """The schedule drafts: a fixed γ > 0, or one chosen each round (`AutoGamma`, `GammaPolicy`)."""
        return self.gamma is not None and not (isinstance(self.gamma, int) and self.gamma <= 0)

    def _join(self, job: Job, target: KVSession, draft: KVSession | None, policy: Any) -> None:
        side = None
        if self.own_sessions:  # its sessions, packed or compiled, stand as one-row stacks
            self.target = SessionRow(target)
            if draft is not None:
                self.draft = SessionRow(draft)
                side = job.draft_side() if self.rewrite is None else None  # its drafter drafts it
        else:
            pipe, sessions = self.pipe, [target] + ([draft] if draft is not None else [])
            if self.target is None:
                self.target = BatchedCache([target], *_packing(pipe, "target", pipe.target))
                if draft is not None:
                    self.draft = BatchedCache([draft], *_packing(pipe, "draft", pipe.draft))
            else:
                self.target.join([target])
                if draft is not None:
                    self.draft.join([draft])
            for s in sessions:
                s.close()  # their caches were copied into the batch
        gamma = None
        if job.policy.do_sample and self.drafting and not self.own_sessions:
            # a seeded sample must not depend on the rows it shares its batch with
            gamma = self.sampled_gamma or (self.gamma if isinstance(self.gamma, int) else GAMMA_START)
        row = _Row(job, gamma, side)
        row.draft_policy = policy
        self.rows.append(row)

    def cancel(self, job: Job) -> bool:
        """Remove a live row now (its tokens so far stay on the job, which is finished); False when
        `job` is not live."""
        for i, row in enumerate(self.rows):
            if row.job is job:
                row.job.stats.notes.append("cancelled")
                self._leave([i])
                return True
        return False

    def _leave(self, gone: Sequence[int]) -> list[Job]:
        """Finish the rows at indices `gone` and drop them from the caches."""
        gone_set = set(gone)
        keep = [i for i in range(len(self.rows)) if i not in gone_set]
        left = [self.rows[i] for i in gone]
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.target = self.draft = None
        else:
            for cache in (self.target, self.draft):
                if cache is not None:
                    cache.select(keep)
            if self.remote is not None:
                self.remote.select(keep)
        for row in left:
            self._finish(row)
        if not self.rows:
            self.gamma = self.plan = None
            self._close_remote()
        return [row.job for row in left]

    def _finish(self, row: _Row) -> None:
        job, s = row.job, row.job.stats
        if row.error is not None:  # failed alone: the other rows go on
            job.error = row.error
            s.notes.append(f"failed: {type(row.error).__name__}: {row.error}")
        if not self.own_sessions:  # on its own sessions the caller finishes it (`decode_alone`)
            job.finish()
            s.seconds_target_decode, s.seconds_draft_decode = row.seconds_target, row.seconds_draft
        if max(row.batch_sizes, default=1) > 1:
            s.notes.append(f"decoded in a batch of {max(row.batch_sizes)} rows at most")
        if self.overlap:
            where = " in its own process" if self.remote is not None else ""
            s.notes.append(f"the draft drafted beside the target{where} (pre-/post-verify)")
        if self.plan is not None:  # the batch's choices; the row's own α and target-only steps
            s.target_steps = row.target_steps
            record, own = self.plan.record(), self.plan.row_acceptance.get(id(s))
            record.pop("alpha", None)  # the live rows' at the last choice
            if own is not None:
                record["alpha"] = own.alpha
            s.plan["gamma"] = record
            self.plan.auto.carried_backoff = self.plan.backoff  # where the next plan starts
        if not self.own_sessions:
            self.pipe.scheduler.batch_done(job)

    # ---- one round ---------------------------------------------------------------------------------
    def step(self) -> list[Job]:
        """One round for every live row; returns the jobs that finished in it. A row whose own work
        fails (its logits processors, its sampler, its verifier) leaves at once with the exception
        on `job.error`, and the other rows go on; an error in a batched forward propagates."""
        for job in list(self._admitted):  # admitted since the last round and not joined yet
            self.join(job)
        if not self.rows:
            return []
        target, draft, rows = self.target, self.draft, self.rows
        g = self.gamma if isinstance(self.gamma, int) else self._planned()
        planned = time.perf_counter()  # the round's own seconds, for the plan's overhead (`GammaPlan.ran`)
        wanted = [g if row.gamma is None else row.gamma for row in rows]  # 0: the target alone
        gammas = [min(w, row.job.remaining - 1) for w, row in zip(wanted, rows)]  # as batch 1 clamps
        proposals: list[DraftProposal | None] = [None] * len(rows)
        # each row's draft tokens on the host (None: still on the device, read with the verdicts)
        chains: list[list[int] | None] = [[] for _ in rows]
        # beside p, a row whose last block was all accepted has its next one drafted already
        # (post-verify), verified whatever γ is now; the others draft one token here and the rest
        # beside p (pre-verify)
        ready = [row.ahead if self.overlap and self.drafting else None for row in rows]
        if any(wanted) or any(r is not None for r in ready):
            inline = [0 if r is not None else min(1, g) if self.overlap else g for r, g in zip(ready, gammas)]
            drafted: list[DraftProposal] = [_EMPTY] * len(rows)
            if any(inline):  # greedy chains stay on the device until the verdicts' read
                try:
                    drafted, chains = self._drafted(rows, inline, read=False)
                except DraftFailure as exc:  # behind its executor: p goes on alone
                    self._draft_failed(exc)
                    chains = [[] for _ in rows]
            # a block drafted ahead is verified whole where γ is fixed (the synchronous prefill's
            # buffer is longer than γ), cut to this round's γ where it is re-chosen each round
            # (GAMMA_START where the plan chose p alone: it costs no drafting)
            whole = isinstance(self.gamma, int)
            for b, (r, row) in enumerate(zip(ready, rows)):
                if r is not None:
                    cut = gammas[b] if wanted[b] else min(GAMMA_START, row.job.remaining - 1)
                    n = row.job.remaining - 1 if whole else cut
                    drafted[b], chains[b] = (_span(r[0], 0, n), r[1][:n]) if r[0].chain else r
            proposals = [
                p if (w or r is not None) and self.drafting else None
                for p, w, r in zip(drafted, wanted, ready)
            ]
        beside, starts = None, [len(row.job.tokens) for row in rows]  # tokens emitted before the round
        if self.overlap and any(wanted) and self.drafting:  # q drafts each row's next block meanwhile
            # after each row's block (a tree's first-child chain): where its draft continues; a chain
            # still on the device (its one token drafted here) is fed to q from there (`tails`)
            tails = [p.tokens if p is not None and c is None else None for p, c in zip(proposals, chains)]
            spines = [
                [] if t is not None else c if p is None or p.chain else p.spine_tokens().tolist()
                for p, c, t in zip(proposals, chains, tails)
            ]
            bases = [row.job.tokens + spine for row, spine in zip(rows, spines)]
            sizes = [len(c) if t is None else t.shape[0] for c, t in zip(spines, tails)]
            more = [min(w + 1, row.job.remaining - n) if w else 0 for row, w, n in zip(rows, wanted, sizes)]
            if self.worker is not None:
                beside = self.worker.start(rows[0].job, more[0], bases[0])
            else:
                beside = self._beside.start(lambda: self._drafted(rows, more, bases, tails=tails))
        for row, prop in zip(rows, proposals):
            row.batch_sizes.append(len(rows))
            if prop is None:
                row.target_steps += 1
        t0 = target.seconds
        try:
            if self.worker is not None:  # timed as its executor times p's work
                self.worker.target(_verify, target, rows, proposals, chains)
            elif self.remote is not None:
                self.remote.target("verify", _verify, target, rows, proposals, chains)
            else:
                _verify(target, rows, proposals, chains)
        finally:
            nxt = None  # never left running
            if beside is not None:  # p accepted all of row b's block: its emitted tokens go on with it
                # a tail was read with the verdicts (`chains[b]`; None where its row failed)
                spines = [sp if t is None else chains[b] for b, (sp, t) in enumerate(zip(spines, tails))]
                accepted = [
                    sp is not None and row.job.tokens[n : n + len(sp)] == sp
                    for row, n, sp in zip(rows, starts, spines)
                ]
                nxt = self._collect(beside, accepted)
        for row in rows:
            row.seconds_target += target.seconds - t0
        for b, row in enumerate(rows):
            row.ahead = None
            if nxt is not None and accepted[b] and len(row.job.tokens) == starts[b] + len(spines[b]) + 1:
                # p accepted the whole block: what q drafted after p's next token is the next block
                row.ahead = _after(nxt[0][b], nxt[1][b], row.job.tokens[-1])
        self.rounds += 1
        if self.plan is not None and (self.worker is None or not self.worker.worker.virtual):
            self.plan.ran(time.perf_counter() - planned, g)
        done = [i for i, row in enumerate(rows) if row.job.done or row.error is not None]
        if done:
            return self._leave(done)
        for cache in (target, draft):
            if cache is not None:
                cache.maybe_compact()
        return []

    def _collect(self, beside: Any, accepted: list[bool]) -> Any:
        """The next blocks drafted beside p (None where the draft failed). `accepted[b]`: p accepted
        all of row b's block, so its continuation may be used; behind a worker that aborts, a
        drafting that cannot be used is stopped first (HIPPO's abort)."""
        try:
            if self.worker is not None:
                return self.worker.result(accepted[0])
            return beside.result()
        except DraftFailure as exc:
            self._draft_failed(exc)
            return None

    def _draft_failed(self, exc: DraftFailure, jobs: Sequence[Job] | None = None) -> None:
        """The draft behind a worker died, hung or raised: the job goes on with p alone, its
        output unchanged."""
        log.warning("hippo: %s; finishing with the target alone (output unchanged)", exc)
        for row in self.rows:
            row.ahead = None
        for job in [row.job for row in self.rows] if jobs is None else jobs:
            job.stats.fallback = True
            job.stats.notes.append(f"draft failed: {exc}")
        self.gamma, self.overlap, self.worker = 0, False, None
        self._close_remote()

    def _drafted(
        self,
        rows: Sequence[_Row],
        gammas: Sequence[int],
        bases: Sequence[list[int]] | None = None,
        read: bool = True,
        tails: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[list[DraftProposal], list[list[int] | None]]:
        """Each row's draft of `gammas[b]` tokens after its emitted tokens (or after `bases[b]`, the
        tokens after the prompt it continues), booked on the draft's clock and the rows' timelines.
        `read=False`: greedy chains stay on the device (None), read with the verdicts (`_draft`);
        `tails[b]`: tokens on the device that continue `bases[b]` (`_draft`)."""
        if self.worker is not None:  # a job alone whose draft is behind its executor
            prop = self.worker.draft(rows[0].job, gammas[0])
            return [prop], [prop.tokens.tolist()]
        if self.remote is not None:  # the rows behind the executor (a draft process): read there
            clock = time.perf_counter()
            based = [row.job.tokens if bases is None else bases[b] for b, row in enumerate(rows)]
            drafted, chains, seconds, forwards, errors = self.remote.draft(based, list(gammas))
            self.clock.add(len(rows), seconds, forwards)
            for row, prop, g, base, error in zip(rows, drafted, gammas, based, errors):
                row.seconds_draft += seconds
                row.error = row.error or error
                if g:
                    pos = row.job.prompt_ids.shape[0] + len(base)
                    row.job.observe("draft", "draft", clock, pos=pos, n=prop.size, depth=prop.depth,
                                    gamma=g, stopped=False)  # fmt: skip
            return drafted, chains
        draft, t0, f0, clock = self.draft, self.draft.seconds, self.draft.forwards, time.perf_counter()
        if self.rewrite is not None:  # every row's chain, batched
            policies = [row.draft_policy for row in rows]
            drafted, chains = _draft(draft, rows, gammas, self.rewrite, bases, policies, read, tails)
        else:  # a job on its own sessions whose drafter has no batched form: it drafts itself
            drafted = [row.side.propose(row.job.prefix(), g) for row, g in zip(rows, gammas)]
            chains = [prop.tokens.tolist() for prop in drafted]
        self.clock.add(draft.rows, draft.seconds - t0, draft.forwards - f0)
        for b, (row, prop, g) in enumerate(zip(rows, drafted, gammas)):
            row.seconds_draft += draft.seconds - t0
            if g and self.rewrite is not None:  # (a drafter books its own)
                tail = 0 if tails is None or tails[b] is None else tails[b].shape[0]
                pos = row.job.prompt_ids.shape[0] + len(row.job.tokens if bases is None else bases[b]) + tail
                row.job.observe("draft", "draft", clock, pos=pos, n=prop.size, depth=prop.depth,
                                gamma=g, stopped=False)  # fmt: skip
        return drafted, chains

    def _planned(self) -> int:
        """The plan's γ for this round, for all live rows: the most expected tokens/s of the batch."""
        rows = self.rows
        target = self.target
        t_draft, live = self.clock.per_forward(target.rows), target
        if self.worker is not None:  # q's seconds per token, on the worker's clock
            t_draft = self.worker.per_token()
            live = None if self.worker.worker.virtual else target  # p's live steps against q's real ones
        if self.plan is None:  # the schedule's own rule (`GammaPolicy`)
            t_verify = target.seconds / target.forwards if target.forwards else None
            info = RoundInfo(self.rounds, tuple(row.job.stats for row in rows), t_verify, t_draft)
            return max(0, int(self.gamma.gamma(info)))
        curve = self.plan.auto.batch_curve(target.rows, target.verify_curve)
        return self.plan.next([row.job.stats for row in rows], t_draft, live, curve)

    def close(self) -> None:
        """Stop the draft thread of the parallel schedules' batches (if one was started); the
        engine makes a new one if it is used again. A job admitted and never joined is finished."""
        for job in list(self._admitted):
            del self._admitted[job]
            self._failed(job)
        if self._beside is not None:
            self._beside.close()
            self._beside = None
        self._close_remote()

    def run(self, jobs: Iterable[Job]) -> None:
        """Add every job, then step until none is live; every job is finished, even on an error."""
        pending = list(jobs)
        if not self.rows:
            self.expected_rows = len(pending)
        try:
            while pending:
                self.add(pending.pop(0))  # a job whose prefill fails is finished by `add`
            while self.rows:
                for job in self.step():
                    if job.error is not None:
                        raise job.error
        except BaseException:
            for row in list(self.rows):
                self.cancel(row.job)
            for job in pending:
                job.finish()
            raise


def decode_alone(scheduler: Any, job: Job, worker: Overlapped | None = None) -> None:
    """Decode `job` alone on the engine loop (a schedule's `Scheduler.run`): a batch of one on the
    job's own sessions and drafter, γ from `scheduler.batch_gamma(job, 1)`; `worker`: its draft
    behind its executor instead, drafting beside p (the parallel schedules). The job is left for the
    caller to finish, as `Scheduler.run` leaves it."""
    engine = Engine(job.pipeline, scheduler=scheduler, own_sessions=True, worker=worker)
    try:
        if engine.add(job):
            while engine.rows:
                engine.step()
    finally:
        if worker is not None:
            worker.close(job)
    if job.error is not None:  # its own work failed: the caller sees why
        raise job.error


interfaces._ENGINE["decode_alone"] = decode_alone  # what `Scheduler.decode` runs

_EMPTY = DraftProposal(tokens=torch.zeros(0, dtype=torch.long))


class Overlapped:
    """The parallel schedules' producer for a job alone: its draft behind its executor's
    `DraftWorker` (a thread and CUDA stream, a process on a device of its own, or a virtual clock),
    driven by the engine's round as the batch's `_Beside` is: q drafts one token, then its next
    block while p verifies (pre-verify), or only the next block while p verifies the one drafted
    ahead (post-verify). `prefill()` prefills both sides as the schedule arranges them (HIPPO's
    synchronous prefill, its early or two-phase pruning) and returns p's session and the tokens q
    drafted meanwhile (or None). `abort`: a drafting that cannot be used is stopped at once
    (HIPPO), not waited for (PEARL)."""

    def __init__(self, executor: Any, worker: Any, prefill: Callable[[], tuple[Any, Any]], abort: bool):
        self.executor, self.worker, self._prefill, self.abort = executor, worker, prefill, abort

    def prefill(self) -> tuple[Any, DraftProposal | None]:
        return self._prefill()

    def draft(self, job: Job, gamma: int) -> DraftProposal:
        """γ tokens after the job's emitted ones, waited for."""
        self.worker.submit(job.prefix(), gamma)
        return self.worker.collect()

    def start(self, job: Job, gamma: int, base: list[int]) -> bool | None:
        """Start drafting γ tokens after `base` (the tokens after the prompt); None: nothing to draft."""
        if gamma <= 0:
            return None
        self.worker.submit(torch.cat([job.prompt_ids, torch.tensor(base, dtype=torch.long)]), gamma)
        return True

    def result(self, accepted: bool) -> tuple[list[DraftProposal], list[list[int]]]:
        """The drafting started last; stopped first where p did not accept its base and `abort`."""
        if self.abort and not accepted:
            self.worker.stop()
        prop = self.worker.collect()
        return [prop], [prop.tokens.tolist()]

    def target(self, fn: Callable[..., Any], *args: Any) -> Any:
        """p's verification, timed as the executor times p's work (its overlap, its virtual clock)."""
        return self.executor.target("verify", fn, *args)

    def close(self, job: Job) -> None:
        """Book the draft's seconds on the job and release its worker."""
        w, s = self.worker, job.stats
        s.seconds_draft_prefill += w.seconds_prefill
        s.seconds_draft_decode += w.seconds_decode
        s.seconds_draft_overlapped += w.seconds_overlapped
        w.close()

    def per_token(self) -> float | None:
        """q's seconds per token drafted (discarded ones included), None before the first."""
        w = self.worker
        return w.seconds_decode / w.tokens_drafted if w.tokens_drafted and w.seconds_decode > 0 else None


def _after(prop: DraftProposal, chain: list[int], token: int) -> tuple[DraftProposal, list[int]] | None:
    """A continuation's draft after p's `token` where it starts, with its tokens on the host (a
    chain's are `chain`: read already), or None (`DraftProposal.after`)."""
    if prop.chain:
        return (_span(prop, 1, prop.size), chain[1:]) if prop.size > 1 and chain[0] == token else None
    rest = prop.after(token)
    return None if rest is None else (rest, rest.tokens.tolist())


def _span(prop: DraftProposal, start: int, stop: int) -> DraftProposal:
    """Tokens start..stop-1 of a chain, with their laws."""
    q = None if prop.q is None else prop.q[start:stop]
    return DraftProposal(tokens=prop.tokens[start:stop], q=q)


class _Beside:
    """The parallel schedules' producer in a batch: q drafts the rows' next blocks on a thread of
    this process while p verifies this round's (on CUDA on a stream of its own, as the `inline`
    executor's draft thread does); `threaded=False` drafts the same blocks in the caller's thread,
    before p verifies (a simulated overlap: the same tokens and draws)."""

    def __init__(self, device: torch.device, threaded: bool = True):
        self.threaded = threaded
        self.pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="hippo-batch-draft") if threaded else None
        )
        self.stream = torch.cuda.Stream(device=device) if threaded and device.type == "cuda" else None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def start(self, fn: Callable[[], Any]) -> Future:
        if self.pool is None:
            done: Future = Future()
            try:
                done.set_result(fn())
            except Exception as exc:  # surfaces at `result()`, as a thread's would
                done.set_exception(exc)
            return done
        ready = None
        if self.stream is not None:  # inputs made on the caller's stream are complete first
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.stream.device))
        return self.pool.submit(self._run, fn, ready)

    def _run(self, fn: Callable[[], Any], ready: Any) -> Any:
        if self.stream is None:
            return fn()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            out = fn()
        self.stream.synchronize()  # its tensors are read on the caller's stream
        return out


def _draft(
    draft: BatchedCache | SessionRow,
    rows: Sequence[_Row],
    gammas: Sequence[int],
    rewrite: Callable[[DraftProposal, int], DraftProposal],
    bases: Sequence[list[int]] | None = None,  # the tokens after each row's prompt it continues
    policies: Sequence[Any] | None = None,  # each row's draft policy (default: its job's)
    read: bool = True,
    tails: Sequence[torch.Tensor | None] | None = None,  # [k] on the device: after bases[b], fed too
) -> tuple[list[DraftProposal], list[list[int] | None]]:  # and each row's chain on the host
    """Each row's chain of `gammas[b]` draft tokens (0: none this round), batched as the `chain`
    drafter drafts one row: q first catches up on the tokens emitted since it last ran (rolling back
    what was not accepted), then feeds each of its tokens but the last.

    Rows that draft greedily with no logits processor keep their tokens on the device: one argmax
    for all of them a step, fed straight back, and one read of the whole [B, γ] table at the end;
    `read=False`: not even that one (their chains are None, their proposals' tokens stay on the
    device, and `_verify` reads them with the verdicts and books what q consumed). `tails[b]`: tokens
    still on the device after `bases[b]` (the parallel schedules' one token drafted before p
    verifies), fed from there with the catch-up and read with this drafting's table.
    A sampled or processed row draws each token on the host (its processors read its sequence)."""
    B = len(rows)
    blocks: list[list[int]] = []  # what each row feeds first: the tokens emitted since q last ran
    for b, row in enumerate(rows):
        if not gammas[b]:
            blocks.append([])
            continue
        emitted = row.job.tokens if bases is None else bases[b]
        common = catch_up(row.draft_generated, emitted, logits_kept=False)  # the stack keeps no logits
        draft.rollback(b, draft.lengths[b] - (len(row.draft_generated) - common))
        del row.draft_generated[common:]
        blocks.append(emitted[common:])
        row.draft_generated.extend(blocks[b])
    policies = [row.job.policy for row in rows] if policies is None else policies
    plain = [not pol.do_sample and not pol.processors for pol in policies]
    steps = max(gammas, default=0)
    table = torch.zeros(B, max(steps, 1), dtype=torch.long, device=draft.device)  # [B, γ] the tokens
    made, fed = [0] * B, [0] * B  # tokens each row drafted, and fed back after the first forward
    drawn: list[list[int]] = [[] for _ in rows]  # a host-drawn row's tokens
    qs: list[list[torch.Tensor]] = [[] for _ in rows]
    tails = [None] * B if tails is None else [t if gammas[b] else None for b, t in enumerate(tails)]
    tail = [0 if t is None else int(t.shape[0]) for t in tails]
    widths, ids, vocab = [len(blk) + k for blk, k in zip(blocks, tail)], None, 0
    if any(tail) and steps:  # the catch-up, then each tail where it is (else `forward` of the blocks)
        ids, widths = _padded(blocks, tails, draft.device)
    for step in range(steps):
        if not any(widths):
            break
        logits = draft.forward(blocks) if ids is None else draft.forward_ids(ids, widths)  # [B, W, V_q]
        vocab = int(logits.shape[-1])
        last = logits[torch.arange(B), torch.tensor([max(w, 1) - 1 for w in widths])]  # [B, V_q]
        col = torch.zeros(B, dtype=torch.long, device=draft.device)  # [B] this step's tokens
        if any(plain):
            col = policies[0].fit(last).float().argmax(-1)  # no read: fed back as it is
        for b, row in enumerate(rows):
            if not widths[b] or made[b] >= gammas[b] or row.error is not None:
                widths[b] = 0
                continue
            if not plain[b]:
                base = row.job.tokens if bases is None else bases[b]
                seq = torch.cat([row.job.prompt_ids, torch.tensor([*base, *drawn[b]], dtype=torch.long)])
                try:
                    x, q = policies[b].draft_token(seq, last[b])
                except Exception as exc:  # this row's own failure: it leaves after the round
                    row.error = exc
                    widths[b] = 0
                    continue
                drawn[b].append(x)
                if q is not None:
                    qs[b].append(q)
                col[b] = x
            made[b] += 1
            widths[b] = 1 if made[b] < gammas[b] else 0
            fed[b] += widths[b]
        table[:, step] = col
        ids = col[:, None]  # [B, 1]
    if not read and rewrite is _unchanged:  # the plain rows' chains stay on the device
        out: list[DraftProposal] = []
        chains_or_none: list[list[int] | None] = []
        for b, row in enumerate(rows):
            if plain[b] and made[b]:
                row.unread_fed = fed[b]
                out.append(DraftProposal(tokens=table[b, : made[b]]))
                chains_or_none.append(None)
            else:
                row.draft_generated.extend(drawn[b][: fed[b]])
                out.append(_host_chain(drawn[b], qs[b]))
                chains_or_none.append(drawn[b])
        return out, chains_or_none
    if any(tail) and steps:  # the tails, read with the table: [B, k + γ]
        k = max(tail)
        both = torch.cat([_padded([[]] * B, tails, table.device)[0], table], dim=1).tolist()  # one read
        host = [r[k:] for r in both]
        for b, row in enumerate(rows):
            row.draft_generated.extend(both[b][: tail[b]])  # q consumed its tail after its catch-up
    else:
        host = table.tolist() if any(plain) and steps else None  # the drafting's one read
    chains = [drawn[b] if not plain[b] else host[b][: made[b]] if host else [] for b in range(B)]
    out = []
    for b, row in enumerate(rows):
        row.draft_generated.extend(chains[b][: fed[b]])
        prop = _host_chain(chains[b], qs[b])
        out.append(rewrite(prop, vocab if prop.q is None else int(prop.q.shape[-1])) if prop.size else prop)
    if rewrite is not _unchanged:  # a drafter rewrote the chains: their tokens are its
        chains = [prop.tokens.tolist() for prop in out]
    return out, chains


def _padded(
    host: Sequence[Sequence[int]], tails: Sequence[torch.Tensor | None], device: torch.device
) -> tuple[torch.Tensor, list[int]]:  # ids [B, W] long on `device`, and each row's width
    """Row b: the tokens `host[b]`, then `tails[b]` copied from where it is (never read), zeros after."""
    widths = [len(h) + (0 if t is None else int(t.shape[0])) for h, t in zip(host, tails)]
    ids = torch.zeros(len(host), max(widths, default=0), dtype=torch.long)
    for b, h in enumerate(host):
        if h:
            ids[b, : len(h)] = torch.tensor(h, dtype=torch.long)
    ids = ids.to(device)
    for b, t in enumerate(tails):
        if t is not None:
            ids[b, len(host[b]) : widths[b]] = t.to(device)
    return ids, widths


def _host_chain(tokens: list[int], qs: list[torch.Tensor]) -> DraftProposal:
    return DraftProposal(tokens=torch.tensor(tokens, dtype=torch.long), q=torch.stack(qs) if qs else None)


def _verify(
    target: BatchedCache | SessionRow,
    rows: Sequence[_Row],
    proposals: Sequence[DraftProposal | None],
    chains: list[list[int] | None],  # each proposal's tokens on the host; None: still on the device
) -> None:
    """One target forward for all rows: each row's pending token and its draft tokens; then the
    verdicts of all rows in one call per verifier (`decide`), and each row keeps its accepted tokens
    in p's cache and emits them (`commit`), or, without a proposal, emits p's next token. A token
    tree (a job on its own session) is scored in one masked pass of that session instead.

    A chain still on the device (`chains[b]` None) is fed to p from there and read back with the
    verdicts, in their one read; `chains[b]` then holds it."""
    t0 = time.perf_counter()
    blocks = []
    for b, (row, prop) in enumerate(zip(rows, proposals)):
        if target.lengths[b] != row.job.length - 1:
            raise RuntimeError(f"row {b}: p holds {target.lengths[b]} tokens, expected {row.job.length - 1}")
        blocks.append([row.job.tokens[-1], *([] if prop is None or chains[b] is None else chains[b])])
    tree = next((prop for prop in proposals if prop is not None and not prop.chain), None)
    unread = [b for b, prop in enumerate(proposals) if prop is not None and chains[b] is None]
    if tree is None:
        if unread:  # the pending tokens, then the device's chains where they are
            tails = [proposals[b].tokens if b in unread else None for b in range(len(blocks))]
            logits = target.forward_ids(*_padded(blocks, tails, target.device))  # [B, W, V]
        else:
            logits = target.forward(blocks)  # [B, W, V]
        keep = lambda b, T, path: target.rollback(b, T + len(path))  # noqa: E731
    else:  # a job alone (`SessionRow`): its tree in one masked pass
        (row,) = rows
        if not row.job.verifier.trees:  # refused before anything is scored
            row.error = UnsupportedError(
                f"verifier {type(row.job.verifier).__name__} verifies chains only, but the drafter made a "
                "token tree; use a stock verifier ('greedy', 'rejection') or leave the verifier unset"
            )
            return
        logits = target.score_tree(row.job.prefix(), tree)  # [1, n+1, V]
        keep = lambda b, T, path: target.keep_tree(T, tree, path)  # noqa: E731
    drafted: list[int] = []  # rows with a proposal, their scores processed
    scores: list[torch.Tensor] = []
    for b, (row, prop) in enumerate(zip(rows, proposals)):
        if row.error is not None:  # failed while drafting: it leaves after this round
            continue
        try:
            if prop is None:  # the target alone, as `Job.target_step`
                kept = row.job.step_from(logits[b, :1])
                row.job.observe("target", "step", t0, pos=row.job.length - kept, emitted=kept)
                continue
            scores.append(process_rows(row.job.policy, row.job.prefix(), prop, logits[b, : prop.size + 1]))
            drafted.append(b)
        except Exception as exc:  # this row's own failure: it leaves, the others go on
            row.error = exc
    if not drafted:
        return
    W = max(s.shape[0] for s in scores)
    stacked = scores[0].new_zeros(len(drafted), W, scores[0].shape[-1])  # [B', W, V]
    for i, s in enumerate(scores):  # [B', W', V]: each row's own positions, then padding none reads
        stacked[i, : s.shape[0]] = s
    groups: dict[int, list[int]] = {}  # rows by verifier: every row's verdict in one call per verifier
    for i, b in enumerate(drafted):
        groups.setdefault(id(rows[b].job.verifier), []).append(i)
    for members in groups.values():
        jobs = [rows[drafted[i]].job for i in members]
        props = [proposals[drafted[i]] for i in members]
        also = None  # [B', γ]: the members' chains, where some are still on the device
        if any(drafted[i] in unread for i in members):
            also = _padded([[]] * len(props), [prop.tokens for prop in props], stacked.device)[0]
        try:
            verdicts, host = decide_reading(
                jobs[0].verifier, props, stacked[members], [job.policy for job in jobs], also
            )
        except Exception as exc:  # the verifier failed: its rows leave, the others go on
            for i in members:
                rows[drafted[i]].error = exc
            continue
        for j, i in enumerate(members):
            b = drafted[i]
            if chains[b] is None:  # read with the verdicts: now q's consumed tokens are known
                chains[b] = host[j][: props[j].size]
                rows[b].draft_generated.extend(chains[b][: rows[b].unread_fed])
        for i, job, verdict in zip(members, jobs, verdicts):
            b = drafted[i]
            try:
                T, prop = job.length, proposals[b]
                _, kept = commit(
                    job, prop, verdict, lambda path, b=b, T=T: keep(b, T, path), tokens=chains[b],
                    logits=logits[b, : prop.size + 1],
                )  # fmt: skip
                a = verdict.n_accepted
                job.observe("target", "verify", t0, pos=T, n=prop.size, depth=prop.depth, accepted=a,
                            rejected=prop.depth - a, emitted=kept)  # fmt: skip
            except Exception as exc:  # this row's own failure: it leaves, the others go on
                rows[b].error = exc
