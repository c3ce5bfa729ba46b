"""The chain drafter: γ tokens, one draft forward each, as in vanilla speculative decoding."""

from __future__ import annotations

import torch

from hippo import hookimpl
from hippo.interfaces import Drafter
from hippo.proposal import DraftProposal


class ChainDrafter(Drafter):
    """x_i ~ q_i for i = 1..γ, feeding each token back; q is returned only when sampling."""

    plain_chains = True  # the batch engine draws these chains itself (`Drafter.plain_chains`)

    def propose(
        self, session, prefix, gamma, policy, should_stop=None
    ) -> DraftProposal:  # as Drafter.propose
        if gamma == 0:
            return DraftProposal(tokens=torch.zeros(0, dtype=torch.long))
        logits = session.sync(prefix)  # [V]
        seq, tokens, qs = prefix, [], []
        for i in range(gamma):
            x, q = policy.draft_token(seq, logits)
            if q is not None:
                qs.append(q)
            tokens.append(x)
            seq = torch.cat([seq, torch.tensor([x])])
            if should_stop is not None and should_stop():
                break
            if i + 1 < gamma:
                logits = session.forward(torch.tensor([x]))[-1]
        q = torch.stack(qs) if qs else None
        return DraftProposal(tokens=torch.tensor(tokens, dtype=torch.long), q=q)


@hookimpl
def hippo_register_drafters():
    return {"chain": ChainDrafter}
