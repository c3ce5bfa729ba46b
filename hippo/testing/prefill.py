"""One prefill for a law check's N runs: the prompt is the same in every run, so its encoding and its
prefilled KV caches are computed once and every run decodes from a copy-on-write fork of them.

A law check samples one fixed prompt N ≈ 2,000 times. About half of a run on the tiny models is the
prompt's work (p's and q's vision towers and prefills), the same in every run: it is deterministic
and draws nothing from the run's generator. `shared_prefill(pipe)` memoises, on the pipeline's own
adapter objects, `encode(inputs)` (by the inputs' contents) and `prefill(encoded, keep)` (by the
encoding and the kept visual indices), and hands every call a fork of the first session
(`hippo.kvcache.fork_cache`: the forks share the prompt's tensors, and a fork's writes never reach
the original). Everything a run samples (the first token, q's drafts, the acceptance draws, the
residuals) still runs per run, on its own generator; the law is the same, at about half the cost.
The adapters are restored when the block ends. Sessions that a static or compiled session kind copies into
a cache of its own (`Pipeline.sessions`) and p's prefill under a scorer (which reads it) are not
shared (packed sessions, the default on CPU, are), and a draft in a child process (the process executor) builds its own adapter there.

`shared_prefill(pipe, replay=True)` goes further: the forks of one prefill also share their decoding
forwards (`Replay`). A session's forward is a deterministic function of the prefill and of what was
done to the session since (the tokens fed, the masked blocks and the rows kept of them, the
rollbacks): its history. So each fork keeps its history, and a forward whose history and inputs one
fork already ran returns that forward's logits and a copy-on-write fork of the cache it left, its
time booked as if it had run. Everything else still runs in every run: the scheduler, the drafter's
and the verifier's rules, every draw, the rollbacks and the rows kept, on the run's own generator;
a pipeline that feeds other tokens, positions or masks, or rolls back to another length, has
another history and gets a forward of its own. On a peaked law most runs follow a few histories, so
a law check's N runs cost about as many forwards as its distinct histories. Plain `KVSession`s
only (the sessions shared above), and only while the thread that opened the block drives them: a
race between threads is not a function of the history, so from the first session operation on
another thread (a draft on its own thread) every forward of the block runs again. A draft in a child
process (the process executor) has sessions of its own there; the target's are replayed.

`shared_prefill(pipe, replay=True, turns=True)` does the same for a conversation's later turn asked
again and again on one video context (`hippo.context.Turn`): the turn's encoding and p's session
extended by the question are computed once per (context, question), every ask getting a fork of
that session (q's prefill on the shared encoding is then shared as above), and their forwards are
replayed by history.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hippo.kvcache import fork_cache
from hippo.session import KVSession, PackedSessions


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def fork_session(session: Any) -> Any:
    """A fresh copy of a just-prefilled `KVSession`: its own cache fork, length and counters."""
    out = copy.copy(session)
    out.cache = fork_cache(session.cache)
    out.generated = []
    out.last_logits = session.prompt_logits
    out.seconds_decode, out.forwards = 0.0, 0
    return out


class _Owner:
    """The thread that opened a `shared_prefill` block; `alone()` is False from the first session
    operation on another thread on (the block's forwards then all run)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.threaded = False

    def alone(self) -> bool:
        if threading.get_ident() != self.thread:
            self.threaded = True
        return not self.threaded


class Replay:
    """The decoding forwards of the sessions forked from one prefill, by history (module docstring).

    `table`: (history, op) -> (logits [k, V], the cache after the op, seconds the forward took);
    a history is the chain of ops since the prefill, each op a tuple of ints (hashable, exact)."""

    def __init__(self, owner: _Owner) -> None:
        self.table: dict[tuple, tuple[torch.Tensor, Any, float]] = {}
        self.owner = owner
        self.hits = 0
        self.misses = 0

    def attach(self, session: Any) -> Any:
        """Make `session` (a fresh fork of the prefill) replay forwards from this table."""
        if type(session) is not KVSession or session.packed is not None:
            return session  # only plain sessions: another kind's forward is not this one
        _Replaying(self, session).install()
        return session


class _Replaying:
    """One fork's history and its replaying forward, forward_masked, keep and rollback."""

    def __init__(self, replay: Replay, session: KVSession):
        self.replay, self.session = replay, session
        self.history: tuple = ()

    def install(self) -> None:
        s = self.session
        s.forward, s.forward_masked = self.forward, self.forward_masked
        s.keep, s.rollback = self.keep, self.rollback

    def _lookup(self, op: tuple) -> tuple[tuple, Any]:
        key = (self.history, op)
        return key, self.replay.table.get(key)

    def _store(self, key: tuple, logits: torch.Tensor, seconds: float) -> None:
        # the table holds a fork: the session's own later writes never reach it (`fork_cache`)
        self.replay.table[key] = (logits.clone(), fork_cache(self.session.cache), seconds)
        self.replay.misses += 1

    def _replayed(self, hit: tuple[torch.Tensor, Any, float], k: int) -> torch.Tensor:
        logits, cache, seconds = hit
        s = self.session
        s.cache = fork_cache(cache)
        s.seconds_decode += seconds
        s.forwards += 1
        s.tokens_forwarded += k
        self.replay.hits += 1
        return logits.clone()

    def forward(self, tokens: torch.Tensor | Any, record: bool = True) -> torch.Tensor:  # [k] -> [k, V]
        """`KVSession.forward`, replayed (`record=False`: the tokens are not added to `generated`)."""
        s = self.session
        if not self.replay.owner.alone() or (
            isinstance(tokens, torch.Tensor) and tokens.device.type != "cpu"
        ):
            return KVSession.forward(s, tokens, record=record)
        host = tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
        op = ("forward", s.length, *host)
        key, hit = self._lookup(op)
        if hit is None:
            t0 = s.seconds_decode
            logits = KVSession.forward(s, tokens, record=record)
            self._store(key, logits, s.seconds_decode - t0)
        else:
            logits = self._replayed(hit, len(host))
            s.length += len(host)
            if record:
                s.generated.extend(host)
            s.last_logits = logits[-1]
        self.history = key
        return logits

    def forward_masked(
        self, tokens: torch.Tensor, offsets: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:  # tokens [k], offsets [k], visible [k, k] -> [k, V]
        s = self.session
        if not self.replay.owner.alone():
            return KVSession.forward_masked(s, tokens, offsets, visible)
        op = (
            "masked",
            s.length,
            s.cache_len(),
            *tokens.reshape(-1).tolist(),
            "at",
            *offsets.reshape(-1).tolist(),
            "visible",
            *visible.reshape(-1).int().tolist(),
        )
        key, hit = self._lookup(op)
        if hit is None:
            t0 = s.seconds_decode
            logits = KVSession.forward_masked(s, tokens, offsets, visible)
            self._store(key, logits, s.seconds_decode - t0)
        else:
            past = s.cache_len()
            logits = self._replayed(hit, int(tokens.shape[0]))
            s._block = (past, tokens.cpu(), logits)
        self.history = key
        return logits

    def keep(self, rows: Any) -> None:
        rows = [int(r) for r in rows]
        KVSession.keep(self.session, rows)  # compacts the session's own fork
        self.history = (self.history, ("keep", *rows))

    def rollback(self, length: int) -> None:
        drop = self.session.length - length
        KVSession.rollback(self.session, length)
        if drop:  # a rollback by nothing leaves the session as it was
            self.history = (self.history, ("rollback", length))


class _Memo:
    def __init__(self, adapter: Any, sessions: bool = True, replay: _Owner | None = None):
        self.adapter, self.share, self.replay = adapter, sessions, replay
        self.replays: list[Replay] = []
        self.encode, self.prefill = adapter.encode, adapter.prefill  # the adapter's own (bound)
        self.encoded: list[tuple[dict, Any]] = []  # (inputs, their encoding)
        self.sessions: dict[tuple[int, tuple[int, ...] | None], tuple[Any, Any, Replay | None]] = {}
        self.hits = 0

    def memo_encode(self, inputs: dict[str, Any]) -> Any:
        for seen, encoded in self.encoded:
            if _same(seen, inputs):
                return encoded
        encoded = self.encode(inputs)
        self.encoded.append((inputs, encoded))
        return encoded

    def memo_prefill(self, encoded: Any, keep: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        if self.replay is not None:
            self.replay.alone()  # a prefill on another thread turns the replay off too
        if args or kwargs or not self.share:  # a call this memo does not know: the adapter's own
            return self.prefill(encoded, keep, *args, **kwargs)
        key = (id(encoded), None if keep is None else tuple(keep.tolist()))
        hit = self.sessions.get(key)
        if hit is None:
            session = self.prefill(encoded, keep)
            if not hasattr(session, "prompt_logits") or not hasattr(session.cache, "layers"):
                return session  # not a KVSession on a DynamicCache: never shared
            replay = None if self.replay is None else Replay(self.replay)
            if replay is not None:
                self.replays.append(replay)
            self.sessions[key] = hit = (encoded, session, replay)  # holds `encoded`: its id stays its own
        else:
            self.hits += 1
        fork = fork_session(hit[1])
        return fork if hit[2] is None else hit[2].attach(fork)

    def install(self) -> None:
        self.adapter.encode, self.adapter.prefill = self.memo_encode, self.memo_prefill

    def remove(self) -> None:
        for name in ("encode", "prefill"):
            self.adapter.__dict__.pop(name, None)


@contextmanager
def _shared_turns(owner: _Owner) -> Iterator[None]:
    """Within the block, `Turn`s with the same context and question share their encoding and p's
    extended session (a fork of it each, replayed by history); with a scorer p's runs every time."""
    from hippo.context import Turn

    own_encoded, own_prefill = Turn.target_encoded, Turn.prefill_target
    encodings: dict[tuple, tuple[Any, Any]] = {}  # (context id, question) -> (context, Encoded)
    sessions: dict[tuple, tuple[Any, Any, Replay]] = {}  # ... -> (context, its session, Replay)

    def key(turn: Any) -> tuple:
        return (id(turn.ctx), tuple(turn.question.tolist()))

    def target_encoded(turn: Any) -> Any:
        if turn._target is None:
            hit = encodings.get(key(turn))
            if hit is None:
                hit = encodings[key(turn)] = (turn.ctx, own_encoded(turn))  # holds ctx: its id stays
            turn._target = hit[1]
        return turn._target

    def prefill_target(turn: Any, scorer: Any) -> Any:
        if scorer is not None:  # the scorer reads p's prefill
            return own_prefill(turn, scorer)
        hit = sessions.get(key(turn))
        if hit is None:
            hit = sessions[key(turn)] = (turn.ctx, own_prefill(turn, scorer), Replay(owner))
        return hit[2].attach(fork_session(hit[1]))

    Turn.target_encoded, Turn.prefill_target = target_encoded, prefill_target
    try:
        yield
    finally:
        Turn.target_encoded, Turn.prefill_target = own_encoded, own_prefill


@contextmanager
def shared_prefill(pipe: Any, replay: bool = False, turns: bool = False) -> Iterator[list[_Memo]]:
    """Within the block, `pipe`'s target and draft adapters encode and prefill each prompt once
    (see the module docstring); yields the memos (`hits`: the prefills shared). With a scorer, p's
    prefill runs every time (the scorer reads it) and only the encodings and q's prefill are shared.
    `replay`: the sessions forked from a shared prefill also share their forwards by history
    (`Replay`; each memo's `replays`), while this thread alone drives them. `turns` (with `replay`):
    so do a video context's later turns (`hippo.context.Turn`)."""
    memos: list[_Memo] = []
    owner = _Owner() if replay else None
    scored = getattr(pipe, "scorer", None) is not None
    kinds = getattr(pipe, "sessions", None) or {}
    for role in ("target", "draft"):
        adapter = getattr(pipe, f"{role}_adapter", None)
        if adapter is None or any(m.adapter is adapter for m in memos):
            continue
        # packed sessions only add packed weights to a session; static and compiled ones copy it
        # into a cache of their own: those prefill as they are
        kind = kinds.get(role)
        plain = kind is None or (isinstance(kind, PackedSessions) and kind.then is None)
        share = plain and not (scored and role == "target")
        memos.append(_Memo(adapter, sessions=share, replay=owner))
    for m in memos:
        m.install()
    try:
        if turns and owner is not None:
            with _shared_turns(owner):
                yield memos
        else:
            yield memos
    finally:
        for m in memos:
            m.remove()
