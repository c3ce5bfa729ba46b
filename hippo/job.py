"""One `generate` call: the state a scheduler drives, and the bookkeeping shared by all schedules.

Where the prompt comes from is a `PromptSource`: a fresh prompt (`FreshPrompt`: encoded and
prefilled whole), or a question on a prepared video (`hippo.context.Turn`: the cached prefix
extended by the question's tokens). The job never asks which one it has.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hippo.accept import verify_round
from hippo.draft import DraftSide
from hippo.events import EventLog, booked, label
from hippo.interfaces import (
    Adapter,
    Drafter,
    Encoded,
    ModelSession,
    Scorer,
    ScoringContext,
    Selector,
    Verifier,
    prefilling,
)
from hippo.types import Stats
from hippo.visual import with_keep_ratio

if TYPE_CHECKING:
    from hippo.interfaces import SessionKind
    from hippo.sampling import TokenPolicy


class Parts(Protocol):
    """The pipeline's parts a job uses (`hippo.pipeline.Pipeline` has them)."""

    target_adapter: Adapter
    draft_adapter: Adapter | None
    scorer: Scorer | None
    selector: Selector
    drafter: Drafter
    sessions: dict[str, SessionKind | None]  # per role: what takes over its prefilled sessions


class PromptSource(Protocol):
    """Where a job's prompt comes from: p's encoding and prefill, and q's encoding."""

    #: "prefill" (the whole prompt) or "extend" (only a question's tokens, after a cached prefix)
    kind: str
    #: per-video memo for question-independent scores (ScoringContext.memo), or None
    memo: dict | None

    def target_encoded(self) -> Encoded: ...
    def prefill_target(self, scorer: Scorer | None) -> ModelSession: ...

    #: how q gets its encoded prompt when q is another model: None = encode the inputs
    draft_encoded: Callable[[], Encoded] | None

    def draft_prefix(self) -> Any: ...  # what a draft process needs to rebuild `draft_encoded` (or None)


@contextmanager
def stage(progress: Callable[[str, str], None] | None, name: str) -> Iterator[None]:
    """Report a long step to `progress(name, "start" | "end")`, if given."""
    if progress is None:
        yield
        return
    progress(name, "start")
    yield
    progress(name, "end")


def _weakly(method: Callable[[], Any]) -> Callable[[], Any]:
    """`method` without a strong reference to its object (which must outlive the calls)."""
    ref = weakref.WeakMethod(method)
    return lambda: ref()()


class FreshPrompt:
    """A prompt encoded and prefilled whole by p's adapter."""

    kind = "prefill"
    memo = None
    draft_encoded = None

    def __init__(self, adapter: Adapter, inputs: dict[str, Any], stage: Callable[[str], Any]):
        self.adapter, self.inputs, self.stage = adapter, inputs, stage
        self._encoded: Encoded | None = None

    def target_encoded(self) -> Encoded:
        if self._encoded is None:
            with self.stage("vision encoding"):
                self._encoded = self.adapter.encode(self.inputs)
        return self._encoded

    def prefill_target(self, scorer: Scorer | None) -> ModelSession:
        encoded = self.target_encoded()
        observe = (
            scorer.observe_target_prefill(self.adapter, encoded) if scorer is not None else nullcontext()
        )
        with observe:
            return self.adapter.prefill(encoded, keep=None)

    def draft_prefix(self) -> None:
        return None


def token_logprobs(
    logits: torch.Tensor,  # [n, V] p's raw logits, row i the one token i was chosen from
    tokens: Sequence[int],  # [n]
    k: int,  # alternatives per token
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each token's log-probability under log_softmax(logits) and the k likeliest (token, log-prob)
    pairs, computed on the logits' device and read back in one transfer. p's own distribution, before
    temperature, top-p or penalties: every emitted token was scored by p, so this is exact."""
    lp = torch.log_softmax(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), -1)
    chosen = lp.gather(-1, torch.as_tensor(tokens, device=lp.device)[:, None])  # [n, 1]
    top = lp.topk(min(k, lp.shape[-1]), -1)  # values, indices [n, k]
    rows = torch.cat([chosen, top.values, top.indices.to(lp.dtype)], -1).tolist()  # [n, 1 + 2k]
    k = top.values.shape[-1]
    return [(r[0], [(int(i), v) for v, i in zip(r[1 : 1 + k], r[1 + k :])]) for r in rows]


class DecodeJob:
    """Prompt, sessions, emitted tokens and stats of one generation.

    Schedulers call `prefill_target`, `draft_side`, `emit`, and `verify_round`; they never
    touch the stopping rules or the statistics directly.
    """

    def __init__(
        self,
        pipeline: Parts,
        inputs: dict[str, Any],
        prompt_ids: torch.Tensor,  # [L]
        policy: TokenPolicy,
        verifier: Verifier,
        max_new_tokens: int,
        eos_ids: Sequence[int],
        streamer: Any = None,
        progress: Callable[[str, str], None] | None = None,  # progress(stage, "start" | "end")
        record_events: bool = False,  # book every piece of work on stats.events (a timeline)
        source: PromptSource | None = None,  # None: a FreshPrompt of `inputs`
    ):
        self.pipeline = pipeline
        self.inputs = inputs
        self.prompt_ids = prompt_ids.cpu()
        self.policy = policy
        self.verifier = verifier
        self.max_new_tokens = max_new_tokens
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.streamer = streamer
        self.progress = progress
        self.source = (
            source
            if source is not None
            else FreshPrompt(pipeline.target_adapter, inputs, functools.partial(stage, progress))
        )
        self.tokens: list[int] = []
        self.stats = Stats()
        self.done = max_new_tokens <= 0
        self.kept: torch.Tensor | None = None
        #: the α a `gamma="auto"` plan of this job starts from (None: the plan's default, 1/2); a
        #: scheduler that runs the job through another one sets it (`auto`: its earlier jobs' α)
        self.alpha_prior: float | None = None
        #: the share of the visual tokens the draft keeps, where a schedule chose it (`auto`'s
        #: keep-ratio planner): the pipeline's selector at that ratio, 1.0 every token unscored;
        #: None: the pipeline's selector as configured
        self.keep_ratio: float | None = None
        #: what made this job fail in a batch while the other rows went on (`hippo.engine`), or None
        self.error: BaseException | None = None
        #: log-probabilities to report: None (the default) computes none; k >= 0 gives each emitted
        #: token's log-probability under p's raw logits and the k likeliest alternatives, in
        #: `token_logprobs` (one entry per token of `tokens`, see `token_logprobs`)
        self.logprobs: int | None = None
        self.token_logprobs: list[tuple[float, list[tuple[int, float]]] | None] = []
        self._t0 = time.perf_counter()
        self._target: ModelSession | None = None
        self._target_encoded = None
        self._draft: DraftSide | None = None
        self.events: EventLog | None = EventLog() if record_events else None

    # ---- sequence -------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self.prompt_ids.shape[0] + len(self.tokens)

    @property
    def remaining(self) -> int:
        return 0 if self.done else self.max_new_tokens - len(self.tokens)

    def prefix(self) -> torch.Tensor:  # [T]
        return torch.cat([self.prompt_ids, torch.tensor(self.tokens, dtype=torch.long)])

    def emit(
        self,
        tokens: Sequence[int],
        logits: torch.Tensor | None = None,  # [m, V] p's raw logits the tokens were chosen from
        rows: Sequence[int] | None = None,  # token i was chosen from logits[rows[i]] (None: row i)
    ) -> int:
        """Append accepted tokens, stopping at EOS or the token budget; returns how many were kept.
        With `logprobs` set, the kept tokens' log-probabilities are read from `logits` (else None)."""
        out = []
        for tok in tokens:
            if self.done:
                break
            out.append(int(tok))
            if int(tok) in self.eos_ids or len(self.tokens) + len(out) >= self.max_new_tokens:
                self.done = True
        if out and not self.tokens:
            self.stats.seconds_ttft = time.perf_counter() - self._t0
        self.tokens.extend(out)
        if out and self.logprobs is not None:
            if logits is None:  # a schedule that emits without p's logits: none to report
                self.token_logprobs += [None] * len(out)
            else:
                picked = logits[list(rows[: len(out)])] if rows is not None else logits[: len(out)]
                self.token_logprobs += token_logprobs(picked, out, self.logprobs)
        if out and self.streamer is not None:
            self.streamer.put(torch.tensor(out, dtype=torch.long))
        return len(out)

    # ---- prefill --------------------------------------------------------------------------
    def stage(self, name: str) -> Any:
        """Report a long step ("vision encoding", "target prefill", "draft prefill") to `progress`."""
        return stage(self.progress, name)

    def target_encoded(self) -> Encoded:
        if self._target_encoded is None:
            self._target_encoded = self._encode_target()
            self.stats.visual_tokens = self._target_encoded.visual.n
        return self._target_encoded

    @booked("target", "vision", seconds="seconds_target_prefill")
    def _encode_target(self) -> Encoded:
        return self.source.target_encoded()

    def prefill_target(self) -> ModelSession:
        if self._target is None:
            self.target_encoded()
            self._target = self._prefill_target()
        return self._target

    @booked("target", "prefill", seconds="seconds_target_prefill")
    def _prefill_target(self) -> ModelSession:
        p = self.pipeline
        sessions = p.sessions["target"]
        with self.stage("target prefill"), prefilling(sessions, p.target_adapter.model):
            target = self.source.prefill_target(p.scorer)
        # after the scorer read the prefill (a static cache copies it)
        return target if sessions is None else sessions.open(target, self.max_new_tokens)

    def select(self, scorer: Scorer | None, keep_ratio: float | None = None) -> torch.Tensor:  # -> [K]
        """Score with `scorer` (reading the target's prefill if it is done) and apply the selector, at
        `keep_ratio` where given (else the job's `keep_ratio`); the kept visual indices."""
        encoded = self.target_encoded()
        keep = self._select(encoded, scorer, self.keep_ratio if keep_ratio is None else keep_ratio)
        self.stats.kept_visual_tokens = int(keep.shape[0])
        return keep

    @booked("target", "prune", seconds="seconds_pruning")
    def _select(self, encoded: Encoded, scorer: Scorer | None, keep_ratio: float | None) -> torch.Tensor:
        p, scores, selector = self.pipeline, None, self.pipeline.selector
        if keep_ratio is not None:
            if keep_ratio >= 1.0:  # nothing pruned: no scoring either
                return torch.arange(encoded.visual.n)  # [N]
            selector = with_keep_ratio(selector, keep_ratio) or selector
        if scorer is not None:
            ctx = ScoringContext(
                adapter=p.target_adapter, encoded=encoded, target=self._target, memo=self.source.memo
            )
            scores = scorer.score(encoded.visual, ctx)
        return selector.select(encoded.visual, scores, self.policy.generator)

    def prune(self) -> torch.Tensor:  # -> [K] kept visual indices
        """The pipeline's pruning (scorer + selector), computed once per job."""
        if self.kept is None:
            self.kept = self.select(self.pipeline.scorer)
        return self.kept

    def new_draft_side(self, own_policy: bool = False) -> DraftSide:
        """A draft side for this job, not prefilled; `own_policy` gives it a forked generator (a draft
        on another thread). Self-speculation (q is p) reuses p's encoding."""
        p = self.pipeline
        same = p.draft_adapter.model is p.target_adapter.model
        # not the bound method itself: the side would hold the job that holds the side (a cycle that
        # keeps both models' caches alive until Python's cyclic collector runs)
        encode = _weakly(self.target_encoded) if same else self.source.draft_encoded
        policy = self.policy.fork() if own_policy else self.policy
        side = DraftSide(
            p.draft_adapter, p.drafter, self.inputs, policy, encode, p.sessions["draft"], self.max_new_tokens
        )
        side.events = self.events
        return side

    def draft_side(self) -> DraftSide:
        """The draft side in this thread, prefilled on the pruned visual tokens (once per job)."""
        if self._draft is None:
            self._draft = self._prefill_draft(self.prune())
        return self._draft

    @booked("draft", None, seconds="seconds_draft_prefill")  # DraftSide.prefill books its events
    def _prefill_draft(self, keep: torch.Tensor) -> DraftSide:  # keep [K]
        side = self.new_draft_side()
        with self.stage("draft prefill"):
            side.prefill(keep)
        return side

    def prefill_draft(self) -> ModelSession:
        """The draft's prefilled session (see `draft_side`)."""
        return self.draft_side().session

    # ---- one speculative round ------------------------------------------------------------
    def first_token(self, target: ModelSession) -> None:
        """Emit the token that follows the prompt, from the target's prefill logits."""
        self.target_step(target)

    def target_step(self, target: ModelSession) -> None:
        """One plain autoregressive step of the target (it first consumes any pending tokens)."""
        t0 = time.perf_counter()
        prefix = self.prefix()
        kept = self.step_from(target.sync(prefix)[None])
        self.observe("target", "step", t0, pos=prefix.shape[0], emitted=kept)

    def step_from(self, logits: torch.Tensor) -> int:  # logits [1, V]: p's, after the prefix
        """Emit p's own next token from its logits (a step of the target alone); how many were kept."""
        scores = self.policy.process(self.prefix(), logits)[0]  # [V]
        return self.emit([self.policy.choose(scores)], logits)

    #: the one verification round (hippo.accept): score, accept, keep, emit, book
    verify_round = verify_round

    def observe(self, side: str, what: str, t0: float, **fields: Any) -> None:
        """Book a piece of work that began at `t0` on the timeline, if one was asked for."""
        if self.events is not None:
            self.events.add(side, what, t0, **fields)

    @property
    def draft_step_seconds(self) -> float | None:
        """Mean seconds of a forward of the draft this thread ran (None: none ran here)."""
        return None if self._draft is None else self._draft.seconds_per_forward

    @property
    def draft_prefill_seconds(self) -> float | None:
        """Seconds of the latest draft prefill this thread ran, its vision encoding left out (None:
        none ran here)."""
        return None if self._draft is None else self._draft.seconds_prefill

    @property
    def seconds_decoding(self) -> float:
        """Seconds since the first token was emitted (to `finish` once finished; 0 before it): the
        decode phase, which the planner's predicted tokens/s are about."""
        s = self.stats
        if not self.tokens:
            return 0.0
        end = s.seconds_total if s.seconds_total else time.perf_counter() - self._t0
        return max(0.0, end - s.seconds_ttft)

    def finish(self) -> None:
        s = self.stats
        s.new_tokens = len(self.tokens)
        s.seconds_total = time.perf_counter() - self._t0
        if self.events is not None:
            s.events = label(self.events.events, self.prompt_ids.shape[0], origin=self._t0)
        if self._target is not None:
            s.seconds_target_decode = self._target.seconds_decode
            s.seconds_compile += self._target.seconds_compile
        if self._draft is not None:
            s.seconds_draft_decode = self._draft.seconds_decode
            s.seconds_compile += self._draft.seconds_compile
        for sess in (self._target, self._draft):
            if sess is not None:
                sess.close()
        if self.streamer is not None:
            self.streamer.end()
