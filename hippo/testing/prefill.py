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
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hippo.kvcache import fork_cache
from hippo.session import PackedSessions


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


class _Memo:
    def __init__(self, adapter: Any, sessions: bool = True):
        self.adapter, self.share = adapter, sessions
        self.encode, self.prefill = adapter.encode, adapter.prefill  # the adapter's own (bound)
        self.encoded: list[tuple[dict, Any]] = []  # (inputs, their encoding)
        self.sessions: dict[tuple[int, tuple[int, ...] | None], tuple[Any, Any]] = {}
        self.hits = 0

    def memo_encode(self, inputs: dict[str, Any]) -> Any:
        for seen, encoded in self.encoded:
            if _same(seen, inputs):
                return encoded
        encoded = self.encode(inputs)
        self.encoded.append((inputs, encoded))
        return encoded

    def memo_prefill(self, encoded: Any, keep: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not self.share:  # a call this memo does not know: the adapter's own
            return self.prefill(encoded, keep, *args, **kwargs)
        key = (id(encoded), None if keep is None else tuple(keep.tolist()))
        hit = self.sessions.get(key)
        if hit is None:
            session = self.prefill(encoded, keep)
            if not hasattr(session, "prompt_logits") or not hasattr(session.cache, "layers"):
                return session  # not a KVSession on a DynamicCache: never shared
            self.sessions[key] = hit = (encoded, session)  # holds `encoded`, so its id stays its own
        else:
            self.hits += 1
        return fork_session(hit[1])

    def install(self) -> None:
        self.adapter.encode, self.adapter.prefill = self.memo_encode, self.memo_prefill

    def remove(self) -> None:
        for name in ("encode", "prefill"):
            self.adapter.__dict__.pop(name, None)


@contextmanager
def shared_prefill(pipe: Any) -> Iterator[list[_Memo]]:
    """Within the block, `pipe`'s target and draft adapters encode and prefill each prompt once
    (see the module docstring); yields the memos (`hits`: the prefills shared). With a scorer, p's
    prefill runs every time (the scorer reads it) and only the encodings and q's prefill are shared."""
    memos: list[_Memo] = []
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
        memos.append(_Memo(adapter, sessions=share))
    for m in memos:
        m.install()
    try:
        yield memos
    finally:
        for m in memos:
            m.remove()
