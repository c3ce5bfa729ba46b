"""The stock verifiers: the acceptance rules of `hippo.accept`, registered under their names.

`greedy` is exact for greedy decoding; `rejection` (Leviathan et al.'s rule) for sampling and, with
one-hot laws, for greedy decoding too. Both verify chains and token trees. `tree` is the name the
tree plugin has always registered: the rule the decoding mode calls for.
"""

from __future__ import annotations

import torch

from hippo import hookimpl
from hippo.accept import accept_greedy, accept_rows, accept_sampled
from hippo.interfaces import Verifier
from hippo.proposal import DraftProposal, Verdict
from hippo.sampling import TokenPolicy


class GreedyVerifier(Verifier):
    greedy_only = True
    trees = True

    def verify(self, proposal: DraftProposal, p_scores: torch.Tensor, policy: TokenPolicy) -> Verdict:
        return accept_greedy(proposal, p_scores)

    def verify_chains(self, proposals, p_scores, policies):
        return accept_rows(proposals, p_scores, policies, greedy=True)


class RejectionVerifier(Verifier):
    trees = True

    def verify(self, proposal: DraftProposal, p_scores: torch.Tensor, policy: TokenPolicy) -> Verdict:
        return accept_sampled(proposal, policy.distribution(p_scores), policy.generator)

    def verify_chains(self, proposals, p_scores, policies):  # greedy rows by argmax, sampled by the rule
        return accept_rows(proposals, p_scores, policies)


class TreeVerifier(RejectionVerifier):
    """Greedy when decoding greedily, rejection sampling when sampling."""

    def verify(self, proposal: DraftProposal, p_scores: torch.Tensor, policy: TokenPolicy) -> Verdict:
        if not policy.do_sample:
            return accept_greedy(proposal, p_scores)
        return super().verify(proposal, p_scores, policy)

    verify_chains = RejectionVerifier.verify_chains  # each row by its mode's rule, every row at once


@hookimpl
def hippo_register_verifiers():
    return {"greedy": GreedyVerifier, "rejection": RejectionVerifier, "tree": TreeVerifier}
