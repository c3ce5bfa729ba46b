"""The corrupting drafter: a test plugin that forces partial acceptance.

It runs a registered drafter, then replaces the draft tokens at chosen positions by wrong ones, so
rounds accept some but not all of their γ tokens (with q rows that say truthfully how each token
was drawn, so the sampling rule stays exact). Notation: p = target, q = draft, γ = draft length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

import hippo
from hippo.interfaces import Drafter
from hippo.proposal import DraftProposal
from hippo.registry import lookup

CORRUPTING = "hippo-testing-corrupting"
PLUGIN_NAME = "hippo-testing-corrupting-drafter"


def _as_bools(value: Any) -> tuple[bool, ...]:
    return tuple(bool(v) for v in value)


class CorruptingDrafter(Drafter):
    """Runs the drafter named `base`, then replaces the draft tokens at the chosen positions.

    `wrong[i]` says whether draft position i of each round (0-based) is replaced. The replacement
    must be a deterministic function of what precedes the draw, so that the reported q row is the
    law it was drawn from and the rejection rule stays exact:
    - greedy (no q): w = (x + shift) mod V, never x itself;
    - sampling: w = the token ranked `rank` under q_i (0 = most likely), a function of q_i only,
      not of the sampled x_i; q_i is then reported as one-hot(w).
    Later draft tokens were drafted after the original x_i; any q is allowed there as long as it
    is reported truthfully, so the round stays exact. Proposals of another type than
    `DraftProposal` (trees) are passed through unchanged.
    """

    @attrs.frozen
    class Config:
        wrong: tuple[bool, ...] = attrs.field(default=(), converter=_as_bools)
        shift: int = attrs.field(default=1, validator=attrs.validators.ge(1))
        rank: int = attrs.field(default=1, validator=attrs.validators.ge(0))
        base: str = "chain"

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.base = lookup("drafters", self.config.base)()

    def propose(
        self, session, prefix, gamma, policy, should_stop=None
    ) -> DraftProposal:  # as Drafter.propose
        if should_stop is None:
            proposal = self.base.propose(session, prefix, gamma, policy)
        else:
            proposal = self.base.propose(session, prefix, gamma, policy, should_stop)
        if not proposal.chain:  # token trees pass through unchanged
            return proposal
        vocab = int(proposal.q.shape[-1]) if proposal.q is not None else int(session.last_logits.shape[-1])
        return self._corrupt(proposal, vocab)

    @property
    def rewrite_chain(self) -> Callable[[DraftProposal, int], DraftProposal] | None:
        """The batched form (`hippo.engine`): the base drafter's, then the corruption; None when the
        base drafter has none."""
        from hippo.engine import chain_rewrite

        base = chain_rewrite(self.base)
        if base is None:
            return None
        return lambda proposal, vocab: self._corrupt(base(proposal, vocab), vocab)

    def _corrupt(self, proposal: DraftProposal, vocab: int) -> DraftProposal:  # vocab: q's V
        tokens = proposal.tokens.clone()  # [γ]
        q = None if proposal.q is None else proposal.q.clone()  # [γ, V] or None
        for i in range(min(int(tokens.shape[0]), len(self.config.wrong))):
            if not self.config.wrong[i]:
                continue
            x = int(tokens[i])
            if q is None:
                step = self.config.shift % vocab or 1
                tokens[i] = (x + step) % vocab
            else:
                order = torch.sort(q[i], descending=True, stable=True).indices  # [V]
                w = int(order[self.config.rank % vocab])
                tokens[i] = w
                q[i] = torch.nn.functional.one_hot(torch.tensor(w), q.shape[-1]).to(q.dtype)
        return DraftProposal(tokens=tokens, q=q)


class _CorruptingPlugin:
    """The plugin object: registers `CorruptingDrafter` as a drafter."""

    @hippo.hookimpl
    def hippo_register_drafters(self) -> dict[str, type]:
        return {CORRUPTING: CorruptingDrafter}


@contextlib.contextmanager
def registered(plugin: Callable[[], Any], name: str, result: Any, pm: Any = None) -> Iterator[Any]:
    """Register `plugin()` on hippo's plugin manager as `name` for the block; yields `result`.

    Re-entrant: inside another block that registered `name` it does nothing more.
    """
    pm = pm or hippo.plugin_manager()
    if pm.get_plugin(name) is not None:
        yield result
        return
    instance = plugin()
    pm.register(instance, name=name)
    try:
        yield result
    finally:
        pm.unregister(plugin=instance)


def corrupting_plugin(pm: Any = None) -> contextlib.AbstractContextManager[str]:
    """Register the corrupting drafter for a block (re-entrant); yields its name."""
    return registered(_CorruptingPlugin, PLUGIN_NAME, CORRUPTING, pm)
