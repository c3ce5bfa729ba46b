"""Verification rules as pure functions, with thin Verifier classes around them.

Definitions (one sequence, draft length γ, vocabulary V):
- *accepted*: the first n draft tokens that the rule keeps, 0 <= n <= γ;
- *recovered*: after a reject at position n, the token drawn in place of x_{n+1};
- *bonus*: when all γ are accepted, the extra token drawn from p_γ.
Every round yields n accepted tokens plus exactly one recovered or bonus token, except when the
caller passes only γ target rows (no p_γ): then a fully accepted round has no bonus token
(`next` is None) and p_γ is left to check the next draft token (PEARL's post-verify mode).
"""

from __future__ import annotations

import torch

from hippo import hookimpl
from hippo.interfaces import Verifier
from hippo.sampling import TokenPolicy
from hippo.types import DraftProposal, Verdict


def greedy_verify(
    draft_tokens: torch.Tensor,  # [γ] long
    p_scores: torch.Tensor,  # [γ+1, V] processed target scores ([γ, V]: no bonus row)
) -> tuple[int, int | None]:
    """Longest prefix of the draft that equals the target's argmax, plus the target's next argmax."""
    target = p_scores.argmax(-1).cpu()  # [γ+1] or [γ]
    gamma = draft_tokens.shape[0]
    match = (draft_tokens.cpu() == target[:gamma]).long()
    n = int(match.cumprod(0).sum())
    return n, (int(target[n]) if n < target.shape[0] else None)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # p, q [V] -> [V]
    """norm(max(0, p - q)); falls back to p when the difference has no mass (then p == q)."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def rejection_verify(
    draft_tokens: torch.Tensor,  # [γ] long, x_i ~ q_i
    q: torch.Tensor,  # [γ, V] draft probabilities
    p: torch.Tensor,  # [γ+1, V] target probabilities ([γ, V]: no bonus row)
    generator: torch.Generator,
) -> tuple[int, int | None]:
    """Speculative sampling (Leviathan et al.): accept x_i with min(1, p_i[x_i] / q_i[x_i]).

    On the first reject, draw the recovered token from norm(max(0, p_i - q_i)); if all γ pass, draw
    the bonus token from p_γ. The output is distributed exactly as a token-by-token sample from p.
    Consumes γ uniforms and, whenever a token is drawn, one categorical draw, so seeded runs are
    reproducible.
    """
    gamma = draft_tokens.shape[0]
    p, q = p.double().cpu(), q.double().cpu()
    x = draft_tokens.cpu()
    idx = torch.arange(gamma)
    p_x, q_x = p[idx, x], q[idx, x]
    u = torch.rand(gamma, generator=generator, dtype=torch.float64)
    accept = (u * q_x < p_x).long()  # u < p/q without dividing; q_x > 0 since x ~ q
    n = int(accept.cumprod(0).sum())
    if n == gamma:
        if p.shape[0] == gamma:  # no bonus row: p_γ checks the next draft token instead
            return n, None
        law = p[gamma]
    else:
        law = residual(p[n], q[n])
    return n, int(torch.multinomial(law, 1, generator=generator))


class GreedyVerifier(Verifier):
    greedy_only = True

    def verify(self, proposal: DraftProposal, p_logits: torch.Tensor, policy: TokenPolicy) -> Verdict:
        return Verdict(*greedy_verify(proposal.tokens, p_logits))


class RejectionVerifier(Verifier):
    """Exact for sampling and, with one-hot laws, for greedy decoding too."""

    def verify(self, proposal: DraftProposal, p_logits: torch.Tensor, policy: TokenPolicy) -> Verdict:
        gamma = proposal.gamma
        q = proposal.q
        if q is None:  # deterministic drafts: q is the one-hot of each proposed token
            q = torch.nn.functional.one_hot(proposal.tokens.cpu(), p_logits.shape[-1]).double()
        n, tok = rejection_verify(proposal.tokens, q, policy.distribution(p_logits), policy.generator)
        assert n <= gamma
        return Verdict(n, tok)


@hookimpl
def hippo_register_verifiers():
    return {"greedy": GreedyVerifier, "rejection": RejectionVerifier}
