"""Planted sampling bugs: real pipeline parts, each one plausible mistake away from exact.

The law test (`assert_sampling_exact`) and `hippo check NAME --sampling` must reject every one of
them; the suite asserts it (tests/test_testing.py). Each is a Verifier or Drafter registered the
normal way, by a plugin object (`planted_plugin()`), so it runs inside a real pipeline:

| name                      | the bug                                                                 |
|---------------------------|-------------------------------------------------------------------------|
| planted_residual_from_p   | after a reject, the recovered token is drawn from p, not norm(max(p - q, 0)) |
| planted_accept_q_over_p   | x_i is accepted with min(1, q/p) instead of min(1, p/q)                 |
| planted_draft_temperature | the draft samples at 4x the temperature, but reports q at the target's |
| planted_bonus_from_q      | after a fully accepted round, the bonus token is drawn from q_γ, not p_γ |
| planted_off_by_one        | x_i is checked against p_{i+1} (the row after its own)                  |
| planted_tree_unnormalised | tree verification: after a rejected child, the next sibling is tested against max(0, r - q_j) without renormalising it |

Under greedy decoding (one-hot laws) the residual, draft-temperature and tree bugs change nothing:
only the law test can see them. The other three also break greedy decoding.
Notation: p = target, q = draft, γ = draft length, r = the residual target at a tree node.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

import hippo
from hippo.interfaces import ModelSession
from hippo.sampling import TokenPolicy
from hippo.testing.drafters import registered
from hippo.types import DraftProposal, Verdict
from hippo_plugins.drafters import ChainDrafter
from hippo_plugins.tree import TreeProposal, TreeVerdict, TreeVerifier
from hippo_plugins.verifiers import RejectionVerifier, residual

PLUGIN_NAME = "hippo-testing-planted-bugs"


def _rule(
    x: torch.Tensor,  # [γ] draft tokens
    q: torch.Tensor,  # [γ, V]
    p: torch.Tensor,  # [γ+1, V] ([γ, V]: no bonus row)
    generator: torch.Generator,
    *,
    accept: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    recover: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = residual,
    bonus: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[int, int | None]:
    """`rejection_verify` with one step replaced; same randomness consumed."""
    gamma = x.shape[0]
    p, q, x = p.double().cpu(), q.double().cpu(), x.cpu()
    checked = p if rows is None else rows(p)  # [γ+1, V] the rows x is checked against
    idx = torch.arange(gamma)
    p_x, q_x = checked[idx, x], q[idx, x]
    u = torch.rand(gamma, generator=generator, dtype=torch.float64)
    ok = (u * q_x < p_x) if accept is None else accept(u, p_x, q_x)
    n = int(ok.long().cumprod(0).sum())
    if n == gamma:
        if p.shape[0] == gamma:
            return n, None
        law = p[gamma] if bonus is None else bonus(p, q)
    else:
        law = recover(checked[n], q[n])
    return n, int(torch.multinomial(law, 1, generator=generator))


class _PlantedChain(RejectionVerifier):
    """The rejection verifier with one planted step (`rule_options`)."""

    rule_options: dict[str, Any] = {}

    def verify(self, proposal: DraftProposal, p_logits: torch.Tensor, policy: TokenPolicy) -> Verdict:
        q = proposal.q
        if q is None:
            q = torch.nn.functional.one_hot(proposal.tokens.cpu(), p_logits.shape[-1]).double()
        p = policy.distribution(p_logits)
        return Verdict(*_rule(proposal.tokens, q, p, policy.generator, **type(self).rule_options))


class ResidualFromP(_PlantedChain):
    """After a reject the recovered token comes from p instead of norm(max(p - q, 0))."""

    rule_options = {"recover": lambda p_row, q_row: p_row}


class AcceptQOverP(_PlantedChain):
    """Accepts x_i with probability min(1, q_i(x_i) / p_i(x_i)): the ratio upside down."""

    rule_options = {"accept": lambda u, p_x, q_x: u * p_x < q_x}


class BonusFromQ(_PlantedChain):
    """Draws the bonus token from the draft's last law q_γ instead of the target's p_γ."""

    rule_options = {"bonus": lambda p, q: q[-1] if q.shape[0] else p[-1]}


class OffByOne(_PlantedChain):
    """Checks draft token x_i against p_{i+1}, the target's row for the *next* position."""

    rule_options = {"rows": lambda p: torch.cat([p[1:], p[-1:]])}


class DraftTemperature(ChainDrafter):
    """The chain drafter sampling at four times the target's temperature, while it reports q as the
    target's settings give it (the law the verifier then trusts)."""

    factor = 4.0

    def propose(
        self,
        session: ModelSession,
        prefix: torch.Tensor,  # [T]
        gamma: int,
        policy: TokenPolicy,
        should_stop: Callable[[], bool] | None = None,
    ) -> DraftProposal:
        if not policy.do_sample:
            return super().propose(session, prefix, gamma, policy, should_stop)
        hot = _HotPolicy(policy, self.factor)
        out = super().propose(session, prefix, gamma, hot, should_stop)
        return out


class _HotPolicy(TokenPolicy):
    """Reports probs at the policy's settings, samples from them at `factor` times the temperature."""

    def __init__(self, policy: TokenPolicy, factor: float):
        super().__init__(policy.processors, policy.do_sample, policy.generator, policy.vocab_size)
        self.factor = factor
        self._last: torch.Tensor | None = None

    def probs(self, scores: torch.Tensor) -> torch.Tensor:  # [k, V]
        self._last = scores
        return super().probs(scores)

    def sample(self, probs: torch.Tensor) -> int:  # probs [V]: the reported q
        hot = torch.softmax(self._last[-1].double() / self.factor, -1)  # [V]
        return super().sample(hot)


def tree_rejection_unnormalised(
    proposal: TreeProposal, p: torch.Tensor, generator: torch.Generator, end: int | None = None
) -> tuple[list[int], int | None]:
    """`tree_rejection` whose residual after a rejected sibling is max(0, r - q_j), not renormalised."""
    p, q = p.double().cpu(), proposal.tree_q.double().cpu()
    children, tokens = proposal.children(), proposal.tree_tokens.tolist()
    path, row = [], 0
    while True:
        r = p[row]
        moved = False
        for c in children[row]:
            x = tokens[c]
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * float(q[c, x]) < float(r[x]):
                path.append(c)
                if c == end:
                    return path, None
                row, moved = c + 1, True
                break
            left = (r - q[c]).clamp_min(0)  # the bug: no division by its mass
            r = left if float(left.sum()) > 0 else p[row]
        if not moved:
            return path, int(torch.multinomial(r, 1, generator=generator))


class TreeUnnormalised(TreeVerifier):
    """The tree verifier with `tree_rejection_unnormalised` for sampling."""

    def verify_tree(
        self,
        proposal: TreeProposal,
        p_logits: torch.Tensor,  # [n+1, V]
        policy: TokenPolicy,
        end: int | None = None,
    ) -> TreeVerdict:
        if not policy.do_sample or proposal.tree_q is None:
            return super().verify_tree(proposal, p_logits, policy, end)
        path, tok = tree_rejection_unnormalised(
            proposal, policy.distribution(p_logits), policy.generator, end
        )
        return TreeVerdict(len(path), tok, tuple(path))


#: name -> (kind, class): the planted parts.
PLANTED: dict[str, tuple[str, type]] = {
    "planted_residual_from_p": ("verifiers", ResidualFromP),
    "planted_accept_q_over_p": ("verifiers", AcceptQOverP),
    "planted_draft_temperature": ("drafters", DraftTemperature),
    "planted_bonus_from_q": ("verifiers", BonusFromQ),
    "planted_off_by_one": ("verifiers", OffByOne),
    "planted_tree_unnormalised": ("verifiers", TreeUnnormalised),
}


class _PlantedPlugin:
    """The plugin object: registers the planted parts."""

    @hippo.hookimpl
    def hippo_register_verifiers(self) -> dict[str, type]:
        return {n: cls for n, (kind, cls) in PLANTED.items() if kind == "verifiers"}

    @hippo.hookimpl
    def hippo_register_drafters(self) -> dict[str, type]:
        return {n: cls for n, (kind, cls) in PLANTED.items() if kind == "drafters"}


def planted_plugin(pm: Any = None) -> contextlib.AbstractContextManager[dict[str, tuple[str, type]]]:
    """Register the planted parts on hippo's plugin manager for the block; yields `PLANTED`."""
    return registered(_PlantedPlugin, PLUGIN_NAME, PLANTED, pm)


def planted_build(name: str) -> Callable[[Any], Any]:
    """The pipeline a planted part runs in: `case.builder` with it as its verifier or drafter (a tree
    verifier gets the tree drafter)."""
    kind, cls = PLANTED[name]

    def build(case: Any) -> Any:
        if kind == "drafters":
            return case.builder(drafter=name)
        if hasattr(cls, "verify_tree"):
            return case.builder(drafter="tree", verifier=name)  # check it with TREE_SETTINGS
        return case.builder(verifier=name)

    return build
