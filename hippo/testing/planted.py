"""Planted sampling bugs: real pipeline parts, each one plausible mistake away from exact.

The law test (`assert_sampling_exact`) and `hippo check NAME --sampling` must reject every one of
them; the suite asserts it (tests/test_testing.py). Each is a Verifier or Drafter registered the
normal way, by a plugin object (`planted_plugin()`), so it runs inside a real pipeline. They
build on the core's interfaces (`hippo.interfaces`, `hippo.accept`) and reach the stock parts
through the registry, as a third-party plugin would:

| name                      | the bug                                                                 |
|---------------------------|-------------------------------------------------------------------------|
| planted_residual_from_p   | after a reject, the recovered token is drawn from p, not norm(max(p - q, 0)) |
| planted_accept_q_over_p   | x_i is accepted with min(1, q/p) instead of min(1, p/q)                 |
| planted_draft_temperature | the draft samples at 4x the temperature, but reports q at the target's |
| planted_bonus_from_q      | after a fully accepted round, the bonus token is drawn from q_γ, not p_γ |
| planted_off_by_one        | x_i is checked against p_{i+1} (the row after its own)                  |
| planted_tree_unnormalised | tree verification: after a rejected child, the next sibling is tested against max(0, r - q_j) without renormalising it |
| planted_greedy_collapse   | decodes greedily while asked to sample: accepts a draft token iff it is p's argmax, then emits p's argmax |

Under greedy decoding (one-hot laws) the residual, draft-temperature, tree and greedy-collapse bugs
change nothing: only the law test can see them. The other three also break greedy decoding. Which
paths exercise each bug, and the look at which each path's law check catches it:
`python -m hippo.testing.matrix` (`hippo.testing.matrix`).
Notation: p = target, q = draft, γ = draft length, r = the residual target at a tree node.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

import hippo
from hippo.accept import accept_greedy, residual
from hippo.interfaces import Drafter, Verifier
from hippo.proposal import DraftProposal, Verdict
from hippo.registry import lookup
from hippo.sampling import TokenPolicy
from hippo.testing.drafters import registered

PLUGIN_NAME = "hippo-testing-planted-bugs"


def _rule(
    proposal: DraftProposal,  # tokens [n], q [n, V] | None, parents [n] | None
    p: torch.Tensor,  # [n+1, V] target probabilities: row 0 at the root, row i+1 after node i
    generator: torch.Generator,
    *,
    accept: Callable[[float, float, float], bool] = lambda u, r_x, q_x: u * q_x < r_x,
    recover: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = residual,
    bonus: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
    rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Verdict:
    """`hippo.accept.accept_sampled` with one step replaced (the same randomness consumed)."""
    p = p.double().cpu()
    checked = p if rows is None else rows(p)  # [n+1, V] the rows each node's children are checked against
    q = torch.nn.functional.one_hot(proposal.tokens.cpu(), p.shape[-1]).double()
    q = q if proposal.q is None else proposal.q.double().cpu()  # [n, V]
    children, tokens = proposal.children(), proposal.tokens.tolist()
    path, row = [], 0
    while True:
        r = checked[row]
        for c in children[row]:
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if accept(u, float(r[tokens[c]]), float(q[c, tokens[c]])):
                path.append(c)
                row = c + 1
                break
            r = recover(r, q[c])
        else:
            leaf = not children[row]
            law = bonus(p[row], q[row - 1] if row else None) if leaf and bonus is not None else r
            return Verdict(tuple(path), int(torch.multinomial(law, 1, generator=generator)))


class _PlantedRule(Verifier):
    """The stock rule (`tree`: greedy when decoding greedily, rejection sampling when sampling) with
    one planted step (`rule_options`), under greedy decoding too (its laws are then one-hot)."""

    rule_options: dict[str, Any] = {}
    trees = True  # it verifies token trees too (`_rule` walks the children), so every path can run it
    #: its bug is between siblings: `planted_build` checks it on trees (the others on chains)
    siblings = False

    def verify(self, proposal: DraftProposal, p_scores: torch.Tensor, policy: TokenPolicy) -> Verdict:
        return _rule(proposal, policy.distribution(p_scores), policy.generator, **type(self).rule_options)


class ResidualFromP(_PlantedRule):
    """After a reject the recovered token comes from p instead of norm(max(p - q, 0))."""

    rule_options = {"recover": lambda p_row, q_row: p_row}


class AcceptQOverP(_PlantedRule):
    """Accepts x_i with probability min(1, q_i(x_i) / p_i(x_i)): the ratio upside down."""

    rule_options = {"accept": lambda u, p_x, q_x: u * p_x < q_x}


class BonusFromQ(_PlantedRule):
    """Draws the bonus token from the draft's last law q_γ instead of the target's p_γ."""

    rule_options = {"bonus": lambda p_leaf, q_leaf: p_leaf if q_leaf is None else q_leaf}


class OffByOne(_PlantedRule):
    """Checks draft token x_i against p_{i+1}, the target's row for the *next* position."""

    rule_options = {"rows": lambda p: torch.cat([p[1:], p[-1:]])}


class DraftTemperature(Drafter):
    """The registered `chain` drafter sampling at four times the target's temperature, while it
    reports q as the target's settings give it (the law the verifier then trusts)."""

    factor = 4.0

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.base = lookup("drafters", "chain")()

    def propose(
        self, session, prefix, gamma, policy, should_stop=None
    ) -> DraftProposal:  # as Drafter.propose
        hot = _HotPolicy(policy, self.factor) if policy.do_sample else policy
        return self.base.propose(session, prefix, gamma, hot, should_stop)


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


def _unnormalised(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # r, q [V] -> [V]
    left = (r - q).clamp_min(0)  # the bug: no division by its mass
    return left if float(left.sum()) > 0 else r


class TreeUnnormalised(_PlantedRule):
    """After a rejected sibling, the next one is tested against max(0, r - q_j), not renormalised."""

    rule_options = {"recover": _unnormalised}
    siblings = True


class GreedyCollapse(Verifier):
    """Decodes greedily while asked to sample: a draft token is accepted iff it is p's argmax there,
    and the token after the accepted path is p's argmax (no draw). Its output is always the likeliest
    path, token by token: on a law check whose likeliest sequence holds <= 0.9 of the mass
    (`sampling.MAX_MODE`) it is at total variation >= 0.1 from the target's law."""

    trees = True
    siblings = False

    def verify(self, proposal: DraftProposal, p_scores: torch.Tensor, policy: TokenPolicy) -> Verdict:
        if not policy.do_sample:
            return accept_greedy(proposal, p_scores)
        p = policy.distribution(p_scores).double().cpu()  # [n+1, V]
        children, tokens = proposal.children(), proposal.tokens.tolist()
        path, row = [], 0
        while True:
            best = int(p[row].argmax())
            child = next((c for c in children[row] if tokens[c] == best), None)
            if child is None:
                return Verdict(tuple(path), best)
            path.append(child)
            row = child + 1


#: name -> (kind, class): the planted parts.
PLANTED: dict[str, tuple[str, type]] = {
    "planted_residual_from_p": ("verifiers", ResidualFromP),
    "planted_accept_q_over_p": ("verifiers", AcceptQOverP),
    "planted_draft_temperature": ("drafters", DraftTemperature),
    "planted_bonus_from_q": ("verifiers", BonusFromQ),
    "planted_off_by_one": ("verifiers", OffByOne),
    "planted_tree_unnormalised": ("verifiers", TreeUnnormalised),
    "planted_greedy_collapse": ("verifiers", GreedyCollapse),
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
        if getattr(cls, "siblings", False):  # its bug is between siblings: check it on trees (TREE_SETTINGS)
            return case.builder(drafter="tree", verifier=name)
        return case.builder(verifier=name)

    return build
