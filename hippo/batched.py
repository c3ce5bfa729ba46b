"""Many prompts decoded together: batched lossless speculative decoding (the serial schedule) and the
batched target alone (its throughput baseline).

Notation: p = target, q = draft, γ = draft length, B = rows, S = cache slots, W = tokens one forward
feeds per row, V = vocabulary, P = position rows (3 for M-RoPE, 1 otherwise).

Each row is a job (`hippo.interfaces.Job`) that the pipeline builds as `Pipeline.generate` builds it,
but with plain sessions, and that is prefilled on its own exactly as `generate` prefills it: p on the
whole prompt, q on the visual tokens the pipeline's scorer and selector keep for that row. The rows'
caches are then stacked on the batch dimension (`BatchedCache`), padded to the longest and carried
with a per-row validity mask of the slots, and every later forward runs all live rows at once:

- a forward feeds W tokens per row (rows with fewer are padded with masked dummy tokens), each row at
  its own positions (its adapter's `positions` function), under a 4-D additive mask [B, 1, W, S + W]
  (the row's valid slots, causal inside the block);
- keys are stored after their rotary embedding, so the order of slots does not matter: a row rolls
  back by marking its rejected slots invalid (no crop), and the cache is compacted (each row's valid
  slots gathered to the front) once the holes pass a threshold;
- a finished row leaves the batch at once (`index_select` on the batch dimension), so it stops
  costing compute.

Ragged rows are padded (as BASS pads), not flattened into one sequence of all rows' tokens (as
vLLM feeds its rejection sampler): flattening needs a variable-length attention kernel over paged
caches, while padding keeps the backbone's own transformers forward, which every adapter's
exactness already rests on; the padding costs little because a round feeds at most γ + 1 tokens per
row and `Pipeline.map` groups rows of similar prompt lengths.

Acceptance, emission and bookkeeping are the batch-1 ones, row by row: each row's scores go through
its own `TokenPolicy`, its verifier decides (`hippo.accept.settle`, the round's own), and the job's
`emit` keeps the EOS and token-budget rules. So each row's answer is its own batch-1 answer:
`target.generate`'s, greedy; the same draws from the row's generator as batch 1 when sampling.

The target's packed linear weights (`hippo.packed`) serve the batched forwards; static-cache
compiled sessions (`hippo.static`) do not: a batch runs on dynamic caches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from hippo.accept import settle
from hippo.compat import grouped_query_sdpa
from hippo.cost import AutoGamma, GammaPlan, VerifyCurve, time_widths
from hippo.errors import UnsupportedError
from hippo.interfaces import Job, prefilling
from hippo.kvcache import SlabLayer
from hippo.packed import MAX_ROWS, PackedLinears
from hippo.proposal import DraftProposal
from hippo.registry import lookup
from hippo.session import KVSession, PackedSessions, embeddable, step_logits

#: compact when at least this share of the cache's slots (beyond the longest row) are holes ...
COMPACT_SHARE = 0.125
#: ... and at least this many
COMPACT_MIN = 16


class BatchedCache:
    """B rows' KV caches of one model, stacked on the batch dimension, each slot valid or not.

    Built from prefilled batch-1 `KVSession`s (their caches are copied; close them afterwards).
    Row b holds `lengths[b]` logical tokens; `slots[b]` lists the cache slot of each token it
    consumed after its prompt, in order (rollback invalidates slots from the end).
    """

    def __init__(self, sessions: Sequence[KVSession], packed: PackedLinears | None = None, max_rows: int = 0):
        if not sessions:
            raise ValueError("a batched cache needs at least one row")
        for s in sessions:
            if not isinstance(s, KVSession) or getattr(s.cache, "layers", None) is None:
                raise UnsupportedError(
                    f"batched decoding needs prefilled KVSessions with a transformers DynamicCache, got "
                    f"{type(s).__name__}; build the pipeline without static-cache sessions"
                )
        first = sessions[0]
        self.model, self.device, self.direct = first.model, first.device, first.direct
        self.dtype = next(self.model.parameters()).dtype
        self.packed, self.max_rows = packed, max_rows
        self.embedding_rows = first.embedding_rows  # ids past them are fed as the last (`embeddable`)
        self.positions = [s.positions for s in sessions]
        self.lengths = [int(s.length) for s in sessions]
        self.slots: list[list[int]] = [[] for _ in sessions]
        sizes = [s.cache_len() for s in sessions]
        S = max(sizes)
        self.cache = first.cache  # its layer objects get the stacked tensors (the sessions are spent)
        for i, layer in enumerate(self.cache.layers):
            if type(layer) not in (DynamicLayer, SlabLayer):
                raise UnsupportedError(
                    f"batched decoding stacks full-attention cache layers only, got {type(layer).__name__}"
                )
            keys, values = [], []
            for s in sessions:
                other = s.cache.layers[i]
                pad = S - other.keys.shape[-2]
                keys.append(torch.nn.functional.pad(other.keys, (0, 0, 0, pad)))  # [1, H, S, D]
                values.append(torch.nn.functional.pad(other.values, (0, 0, 0, pad)))
            layer.keys, layer.values = torch.cat(keys), torch.cat(values)  # [B, H, S, D]
        self.valid = torch.arange(S)[None] < torch.tensor(sizes)[:, None]  # [B, S] bool
        self.seconds = 0.0  # wall-clock seconds in forwards
        self.forwards = 0

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def seconds_decode(self) -> float:  # as a session's (`hippo.cost.GammaPlan` times steps with it)
        return self.seconds

    @property
    def size(self) -> int:  # S: slots per row
        return int(self.valid.shape[1])

    @torch.inference_mode()
    def forward(self, blocks: Sequence[Sequence[int]]) -> torch.Tensor:  # -> logits [B, W, V]
        """Feed row b the tokens `blocks[b]` at its next logical positions (an empty block: the row
        only carries dummies this time). Column i of row b's logits follows its token i; columns
        from `len(blocks[b])` on are dummies, masked from every real token and invalid afterwards.
        """
        t0 = time.perf_counter()
        B, S = self.rows, self.size
        widths = [len(b) for b in blocks]
        W = max(widths)
        if len(blocks) != B or W == 0:
            raise ValueError(f"forward needs one block per row ({B}) and some token, got widths {widths}")
        ids = torch.zeros(B, W, dtype=torch.long)
        for b, toks in enumerate(blocks):
            ids[b, : len(toks)] = torch.as_tensor(list(toks), dtype=torch.long)
        ids = embeddable(ids, self.embedding_rows)
        pos = torch.cat(
            [fn(n, W) for fn, n in zip(self.positions, self.lengths)], dim=-2
        )  # [P, B, W] | [B, W]
        real = torch.arange(W)[None] < torch.tensor(widths)[:, None]  # [B, W]
        allowed = torch.cat(
            [
                self.valid[:, None, :].expand(B, W, S),
                torch.ones(W, W, dtype=torch.bool).tril().expand(B, W, W),
            ],
            dim=-1,
        )  # [B, W, S + W]
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(
            ~allowed, torch.finfo(self.dtype).min
        )
        kernels = self.packed.rows(B * W, self.max_rows) if self.packed is not None else nullcontext()
        with kernels, grouped_query_sdpa(self.device):
            logits = step_logits(
                self.model,
                self.direct,
                self.cache,
                input_ids=ids.to(self.device),
                position_ids=pos.to(self.device),
                attention_mask=mask[:, None].to(self.device),
            )  # [B, W, V]
        for b, n in enumerate(widths):
            self.slots[b].extend(range(S, S + n))
            self.lengths[b] += n
        self.valid = torch.cat([self.valid, real], dim=1)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.seconds += time.perf_counter() - t0
        self.forwards += 1
        return logits

    @torch.inference_mode()
    def rollback(self, row: int, length: int) -> None:
        """Forget row `row`'s tokens after its first `length` logical tokens."""
        drop = self.lengths[row] - length
        if drop < 0 or drop > len(self.slots[row]):
            raise ValueError(f"row {row}: cannot roll back from {self.lengths[row]} to {length} tokens")
        if drop:
            gone = self.slots[row][-drop:]
            del self.slots[row][-drop:]
            self.valid[row, gone] = False
            self.lengths[row] = length

    def verify_curve(self, widths: Sequence[int], repeats: int = 2) -> VerifyCurve:
        """t_verify(B, k) of this batch (B = its rows): forwards of k filler tokens in every row, each
        rolled back and its slots cropped, so the cache ends as it began (`hippo.cost.time_widths`)."""
        lengths, size = list(self.lengths), self.size

        def restore() -> None:
            for b, n in enumerate(lengths):
                self.rollback(b, n)
            self._crop(size)

        return time_widths(lambda k: self.forward([[0] * k] * self.rows), restore, widths, repeats)

    @torch.inference_mode()
    def _crop(self, size: int) -> None:
        """Drop the slots from `size` on (all invalid: rolled back)."""
        if bool(self.valid[:, size:].any()):
            raise RuntimeError("cannot crop valid slots")
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :size], layer.values[:, :, :size]
        self.valid = self.valid[:, :size]

    @torch.inference_mode()
    def select(self, rows: Sequence[int]) -> None:
        """Keep only the rows `rows` (in that order): finished rows leave the batch."""
        if list(rows) == list(range(self.rows)):
            return
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        for layer in self.cache.layers:
            i = idx.to(layer.keys.device)
            layer.keys, layer.values = layer.keys.index_select(0, i), layer.values.index_select(0, i)
        self.valid = self.valid.index_select(0, idx)
        self.positions = [self.positions[r] for r in rows]
        self.lengths = [self.lengths[r] for r in rows]
        self.slots = [self.slots[r] for r in rows]
        self.maybe_compact()

    @torch.inference_mode()
    def maybe_compact(self) -> None:
        """Gather each row's valid slots to the front when the holes pass the threshold."""
        counts = self.valid.sum(1)  # [B]
        keep = int(counts.max()) if self.rows else 0
        holes = self.size - keep
        if holes < max(COMPACT_MIN, COMPACT_SHARE * self.size):
            return
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :keep]  # [B, keep]
        rank = self.valid.long().cumsum(1) - 1  # [B, S]: new slot of each valid slot
        for layer in self.cache.layers:
            B, H, _, D = layer.keys.shape
            g = order.to(layer.keys.device)[:, None, :, None].expand(B, H, keep, D)
            layer.keys, layer.values = layer.keys.gather(2, g), layer.values.gather(2, g)
        self.slots = [rank[b, s].tolist() for b, s in enumerate(self.slots)]
        self.valid = torch.arange(keep)[None] < counts[:, None]  # [B, keep]


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
    """The session kinds of a batch's rows, per role (`Pipeline.generate_batch`)."""
    return {role: None if kind is None else _RowPrefill(kind) for role, kind in pipe.sessions.items()}


def _packing(pipe: Any, role: str, model: torch.nn.Module) -> tuple[PackedLinears | None, int]:
    kind = pipe.sessions.get(role)
    if isinstance(kind, PackedSessions):
        return PackedLinears.of(model), kind.max_rows
    return None, MAX_ROWS


# ---- drafters --------------------------------------------------------------------------------


def chain_rewrite(drafter: Any) -> Callable[[DraftProposal, int], DraftProposal] | None:
    """How `drafter` drafts in a batch, or None when it cannot: each row's chain is drawn token by
    token from q, as the registered `chain` drafter draws it, then passed through the returned
    function with q's vocabulary size. The `chain` drafter itself changes nothing; another drafter
    takes part by defining `rewrite_chain(proposal, vocab) -> DraftProposal` (or None: no batched form).
    """
    rewrite = getattr(drafter, "rewrite_chain", None)
    if rewrite is not None:
        return rewrite
    if type(drafter) is lookup("drafters", "chain"):
        return _unchanged
    return None


def _unchanged(proposal: DraftProposal, vocab: int) -> DraftProposal:
    return proposal


# ---- the rows --------------------------------------------------------------------------------


class _Row:
    """One row: its job, the tokens its draft consumed after the prompt, and its decode seconds."""

    def __init__(self, job: Job):
        self.job = job
        self.draft_generated: list[int] = []
        self.seconds_target = 0.0
        self.seconds_draft = 0.0
        self.target_steps = 0  # batched steps of the target alone (γ = 0) while this row was live


def decode_jobs(pipe: Any, jobs: Sequence[Job], gamma: int | str | AutoGamma) -> None:
    """Decode the jobs together: speculative rounds of up to γ draft tokens, or the target alone
    (γ = 0); `gamma` "auto" (`batch_gamma`): as the pipeline's scheduler decides (`scheduler="auto"`:
    its `run_batch`; `serial` with `gamma="auto"`: its AutoGamma); an AutoGamma: γ re-chosen each
    round for the whole batch (`hippo.cost`). Prefills each job on its own, runs all to the end and
    finishes them (their stats)."""
    if isinstance(gamma, str):
        scheduler = pipe.scheduler
        if hasattr(scheduler, "run_batch"):
            scheduler.run_batch(jobs, lambda jobs, gamma: decode_jobs(pipe, jobs, gamma))
            return
        gamma = scheduler.auto
    rows = [_Row(j) for j in jobs]
    plan = gamma.plan(parallel=False) if isinstance(gamma, AutoGamma) else None
    try:
        _decode(pipe, rows, gamma, plan)
    finally:
        for row in rows:
            row.job.finish()
            s = row.job.stats
            s.seconds_target_decode, s.seconds_draft_decode = row.seconds_target, row.seconds_draft
            s.notes.append(f"decoded in a batch of {len(rows)} rows")
            if plan is not None:  # the batch's choices; the row's own α and target-only steps
                s.target_steps = row.target_steps
                record, own = plan.record(), plan.row_acceptance.get(id(s))
                record.pop("alpha", None)  # the live rows' at the last choice
                if own is not None:
                    record["alpha"] = own.alpha
                s.plan["gamma"] = record


class _DraftClock:
    """Seconds per batched draft forward, per batch size B, in this call."""

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


def _decode(pipe: Any, rows: list[_Row], gamma: int | AutoGamma, plan: GammaPlan | None) -> None:
    drafting = plan is not None or gamma > 0
    rewrite = None
    if drafting:
        rewrite = chain_rewrite(pipe.drafter)
        if rewrite is None:
            raise UnsupportedError(
                f"drafter {type(pipe.drafter).__name__} has no batched form (rewrite_chain); use the "
                "'chain' drafter to decode a batch, or decode the prompts one by one"
            )
    live: list[_Row] = []
    targets: list[KVSession] = []
    drafts: list[KVSession] = []
    for row in rows:  # each prefilled as generate prefills it
        job = row.job
        target = job.prefill_target()
        job.first_token(target)
        if job.done:
            continue
        live.append(row)
        targets.append(target)
        if drafting:
            drafts.append(job.prefill_draft())
    if not live:
        return
    target = BatchedCache(targets, *_packing(pipe, "target", pipe.target))
    draft = BatchedCache(drafts, *_packing(pipe, "draft", pipe.draft)) if drafting else None
    for s in (*targets, *drafts):
        s.close()  # their caches were copied into the batch
    clock = _DraftClock()
    while live:
        g = gamma
        if plan is not None:  # γ for all live rows: the most expected tokens/s of the batch
            curve = plan.auto.batch_curve(target.rows, target.verify_curve)
            g = plan.next([row.job.stats for row in live], clock.per_forward(target.rows), target, curve)
        proposals: list[DraftProposal | None] = [None] * len(live)
        if g > 0:
            t0, f0 = draft.seconds, draft.forwards
            proposals = _draft(draft, live, g, rewrite)
            clock.add(draft.rows, draft.seconds - t0, draft.forwards - f0)
            for row in live:
                row.seconds_draft += draft.seconds - t0
        else:
            for row in live:
                row.target_steps += 1
        t0 = target.seconds
        _verify(target, live, proposals)
        for row in live:
            row.seconds_target += target.seconds - t0
        still = [i for i, row in enumerate(live) if not row.job.done]
        if len(still) < len(live):  # finished rows leave the batch
            live = [live[i] for i in still]
            if not live:
                break
            for cache in (target, draft):
                if cache is not None:
                    cache.select(still)
        else:
            for cache in (target, draft):
                if cache is not None:
                    cache.maybe_compact()


def _draft(
    draft: BatchedCache,
    rows: Sequence[_Row],
    gamma: int,
    rewrite: Callable[[DraftProposal, int], DraftProposal],
) -> list[DraftProposal]:
    """Each row's chain of up to γ draft tokens (fewer near its token budget), batched as the `chain`
    drafter drafts one row: q first catches up on the tokens emitted since it last ran (rolling back
    what was not accepted), then feeds each of its tokens but the last."""
    gammas = [min(gamma, row.job.remaining - 1) for row in rows]
    seqs = [row.job.prefix() for row in rows]  # [T] each
    blocks: list[list[int]] = []
    for b, row in enumerate(rows):
        if not gammas[b]:
            blocks.append([])
            continue
        emitted, common = row.job.tokens, 0
        for x, y in zip(row.draft_generated, emitted):
            if x != y:
                break
            common += 1
        common = min(common, len(emitted) - 1)  # q's logits after the last emitted token are needed
        draft.rollback(b, draft.lengths[b] - (len(row.draft_generated) - common))
        del row.draft_generated[common:]
        blocks.append(emitted[common:])
    tokens: list[list[int]] = [[] for _ in rows]
    qs: list[list[torch.Tensor]] = [[] for _ in rows]
    vocab = 0
    for _ in range(max(gammas, default=0)):
        logits = draft.forward(blocks)  # [B, W, V_q]
        vocab = int(logits.shape[-1])
        nxt: list[list[int]] = []
        for b, row in enumerate(rows):
            row.draft_generated.extend(blocks[b])
            if len(tokens[b]) >= gammas[b]:
                nxt.append([])
                continue
            policy = row.job.policy
            seq = torch.cat([seqs[b], torch.tensor(tokens[b], dtype=torch.long)])
            scores = policy.process(seq, policy.fit(logits[b, len(blocks[b]) - 1])[None])  # [1, V]
            if policy.do_sample:
                q = policy.probs(scores)[0]
                x = policy.sample(q)
                qs[b].append(q)
            else:
                x = int(scores[0].argmax())
            tokens[b].append(x)
            nxt.append([x] if len(tokens[b]) < gammas[b] else [])
        blocks = nxt
    out = []
    for b in range(len(rows)):
        prop = DraftProposal(
            tokens=torch.tensor(tokens[b], dtype=torch.long), q=torch.stack(qs[b]) if qs[b] else None
        )
        out.append(rewrite(prop, vocab if prop.q is None else int(prop.q.shape[-1])) if prop.size else prop)
    return out


def _verify(target: BatchedCache, rows: Sequence[_Row], proposals: Sequence[DraftProposal | None]) -> None:
    """One target forward for all rows: each row's pending token and its draft tokens; then each row
    accepts, rolls back and emits as its batch-1 round (or, without a proposal, its target step)."""
    blocks = []
    for b, (row, prop) in enumerate(zip(rows, proposals)):
        if target.lengths[b] != row.job.length - 1:
            raise RuntimeError(f"row {b}: p holds {target.lengths[b]} tokens, expected {row.job.length - 1}")
        blocks.append([row.job.tokens[-1], *([] if prop is None else prop.tokens.tolist())])
    logits = target.forward(blocks)  # [B, W, V]
    for b, (row, prop) in enumerate(zip(rows, proposals)):
        job = row.job
        if prop is None:  # the target alone, as `Job.target_step`
            job.step_from(logits[b, :1])
            continue
        settle(
            job,
            prop,
            logits[b, : prop.size + 1],
            lambda path, b=b, T=job.length: target.rollback(b, T + len(path)),
        )


def batch_gamma(pipe: Any) -> int | str | None:
    """γ of the pipeline's schedule in a batch (0: the target alone; "auto": chosen by the scheduler,
    `scheduler="auto"` or `serial` with `gamma="auto"`), or None when it has no batched form (a
    parallel schedule, a drafter without `rewrite_chain`)."""
    name = pipe.names.get("scheduler")
    if name == "autoregressive":
        return 0
    if name not in ("serial", "auto") or chain_rewrite(pipe.drafter) is None:
        return None
    if name == "auto":
        return "auto"
    gamma = getattr(pipe.scheduler.config, "gamma", None)
    return gamma if isinstance(gamma, int) or gamma == "auto" else None
