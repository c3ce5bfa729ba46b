"""The draft side of one job: the draft model's encoding, its (pruned) prefill, its policy, its proposals.

Executors only decide where a `DraftSide` runs (this thread, a worker thread, a child process) and
when; what it computes is the same everywhere. Notation: q = draft, γ = draft length, K = kept
visual tokens, T = tokens in the sequence so far.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hippo.interfaces import prefilling

if TYPE_CHECKING:
    from hippo.events import EventLog
    from hippo.interfaces import Adapter, Drafter, Encoded, ModelSession, SessionKind
    from hippo.proposal import DraftProposal
    from hippo.sampling import TokenPolicy


class DraftSide:
    """The draft model with its KV cache for one job.

    `encode` replaces the draft's own vision encoding (self-speculation reuses the target's).
    The session is rebuilt by each `prefill(keep)` (a two-phase pruning re-prefills it).
    """

    def __init__(
        self,
        adapter: Adapter,
        drafter: Drafter,
        inputs: dict[str, Any],
        policy: TokenPolicy,
        encode: Callable[[], Encoded] | None = None,
        sessions: SessionKind | None = None,  # takes over each prefilled session (Pipeline.sessions)
        new_tokens: int = 0,  # tokens the job may generate (a static cache's room)
    ):
        self.adapter, self.drafter, self.inputs, self.policy = adapter, drafter, inputs, policy
        self._encode = encode
        self.sessions, self.new_tokens = sessions, new_tokens
        self._encoded: Encoded | None = None
        self.session: ModelSession | None = None
        self._seconds_closed = 0.0  # forward seconds of sessions replaced by a later prefill
        self._forwards_closed = 0  # and their forward passes
        self._compile_closed = 0.0  # and their compiling seconds
        self.events: EventLog | None = None  # where to book its work (a timeline was asked for)
        #: seconds of the latest prefill's forward (its vision encoding left out; None: none yet)
        self.seconds_prefill: float | None = None

    def encoded(self) -> Encoded:
        if self._encoded is None:
            t0 = time.perf_counter()
            self._encoded = self._encode() if self._encode is not None else self.adapter.encode(self.inputs)
            if self.events is not None and self._encode is None:  # its own vision tower
                self.events.add("draft", "vision", t0)
        return self._encoded

    def prefill(self, keep: torch.Tensor | None) -> ModelSession:  # keep [K] kept visual indices
        """(Re)build the draft's session on the kept visual tokens."""
        encoded = self.encoded()
        t0 = time.perf_counter()
        self._drop_session()
        with prefilling(self.sessions, self.adapter.model):
            self.session = self.adapter.prefill(encoded, keep)
        if self.sessions is not None:
            self.session = self.sessions.open(self.session, self.new_tokens)
        self.seconds_prefill = time.perf_counter() - t0
        if self.events is not None:
            self.events.add("draft", "prefill", t0)
        return self.session

    def propose(
        self,
        prefix: torch.Tensor,  # [T]
        gamma: int,
        should_stop: Callable[[], bool] | None = None,
    ) -> DraftProposal:
        """Draft up to γ tokens continuing `prefix` (fewer if `should_stop()` turns true)."""
        t0 = time.perf_counter()
        if should_stop is None:
            prop = self.drafter.propose(self.session, prefix, gamma, self.policy)
        else:
            prop = self.drafter.propose(self.session, prefix, gamma, self.policy, should_stop)
        if self.events is not None:
            stopped = should_stop is not None and prop.depth < gamma and should_stop()
            self.events.add(
                "draft",
                "draft",
                t0,
                pos=prefix.shape[0],
                n=prop.size,
                depth=prop.depth,
                gamma=gamma,
                stopped=stopped,
            )
        return prop

    @property
    def seconds_decode(self) -> float:
        """Seconds in the draft's forward passes after its prefills."""
        return self._seconds_closed + (0.0 if self.session is None else self.session.seconds_decode)

    @property
    def seconds_per_forward(self) -> float | None:
        """Mean seconds of one draft forward so far (None before the first)."""
        forwards = self._forwards_closed + (0 if self.session is None else self.session.forwards)
        return self.seconds_decode / forwards if forwards else None

    @property
    def seconds_compile(self) -> float:
        """Seconds of compiling in the draft's static-cache sessions (0 without them)."""
        return self._compile_closed + (0.0 if self.session is None else self.session.seconds_compile)

    def _drop_session(self) -> None:
        if self.session is not None:
            self._compile_closed += self.session.seconds_compile
            self._seconds_closed += self.session.seconds_decode
            self._forwards_closed += self.session.forwards
            self.session.close()
            self.session = None

    def close(self) -> None:
        self._drop_session()
