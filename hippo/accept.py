"""How a draft token is accepted: the two acceptance rules and the verification round.

Notation (as in the paper): p = target, q = draft, γ = draft length, V = vocabulary, T = tokens in the
sequence so far, n = draft tokens in a proposal (γ for a chain; the nodes of a token tree).

A proposal (`hippo.proposal.DraftProposal`) is n draft tokens stored parent-first, each continuing
the path to its parent; a chain is the tree without siblings, so chains and trees are verified by the
same two rules, walking from the root:

- **greedy**: at node v move to the child whose token is argmax p_v; at the first node without one,
  emit argmax p_v. The accepted path is the longest one that greedy decoding of p would emit.
- **sampling** (Leviathan et al.; recursive, without replacement, for siblings as in SpecInfer):
  at node v, with residual r = p_v and children c_1..c_k drawn from laws q_1..q_k, accept c_j with
  probability min(1, r(c_j) / q_j(c_j)); on accept move to c_j, on reject set r <- norm(max(0, r - q_j)).
  When no child is accepted, draw the next token from r. By induction over the children left, the
  token emitted at v is distributed as p_v whatever the drafts were, so the output is distributed as
  sampling from p token by token. (A tree drafter draws sibling j from q with siblings 1..j-1 zeroed
  and records that law as q_j; a chain has one child per node and q_j = q.)

Each round therefore yields:
- *accepted* tokens: the path of draft tokens the rule keeps (0 to the proposal's depth);
- one *recovered* token (drawn after the last reject, from r) or *bonus* token (after a leaf, from
  p at the leaf): `Verdict.next_token`.

PEARL's post-verify (the parallel schedules' `bonus=False`): the draft has already continued after
the proposal's first-child chain (its *spine*). When the accepted path is that whole spine, the round
drops its bonus token; p at the spine's end stays in the target's cache and checks the continuation's
first token in the next round. A dropped draw is fresh randomness never used, so this is exact too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from hippo.errors import UnsupportedError
from hippo.proposal import DraftProposal, TokenPolicy, Verdict

# ---- the two rules, as pure functions ---------------------------------------------------------


def accept_greedy(
    proposal: DraftProposal,
    p_scores: torch.Tensor,  # [n+1, V] processed target scores: row 0 at the root, row i+1 after node i
) -> Verdict:
    """The longest path of draft tokens equal to p's argmax at each step, then p's next argmax."""
    best = p_scores.argmax(-1).tolist()  # [n+1]
    children, tokens = proposal.children(), proposal.tokens.tolist()
    path, row = [], 0
    while True:
        nxt = next((c for c in children[row] if tokens[c] == best[row]), None)
        if nxt is None:
            return Verdict(tuple(path), best[row])
        path.append(nxt)
        row = nxt + 1


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # p, q [V] -> [V]
    """norm(max(0, p - q)); falls back to p when the difference has no mass (then p == q)."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def accept_sampled(
    proposal: DraftProposal,  # tokens [n], q [n, V] (None: each token was certain, q one-hot)
    p: torch.Tensor,  # [n+1, V] target probabilities: row 0 at the root, row i+1 after node i
    generator: torch.Generator,
) -> Verdict:
    """Rejection sampling down the tree (see the module docstring): accepted path + next token.

    Consumes one uniform per child tested and one categorical draw, so seeded runs are reproducible.
    """
    p = p.double().cpu()
    q = None if proposal.q is None else proposal.q.double().cpu()
    children, tokens = proposal.children(), proposal.tokens.tolist()
    path, row = [], 0
    while True:
        r = p[row]  # [V] residual target at this node
        for c in children[row]:
            x = tokens[c]
            q_c = q[c] if q is not None else torch.zeros_like(r).index_fill_(0, torch.tensor(x), 1.0)
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * float(q_c[x]) < float(r[x]):  # u < r(x) / q_c(x); q_c(x) > 0 since x ~ q_c
                path.append(c)
                row = c + 1
                break
            r = residual(r, q_c)
        else:  # no child accepted (or a leaf): the recovered or bonus token
            return Verdict(tuple(path), int(torch.multinomial(r, 1, generator=generator)))


# ---- the verification round -------------------------------------------------------------------


class RoundJob(Protocol):
    """What the round reads and writes on the job (hippo.job.DecodeJob)."""

    policy: TokenPolicy
    verifier: Any  # hippo.interfaces.Verifier
    stats: Any  # hippo.types.Stats

    def prefix(self) -> torch.Tensor: ...  # [T]
    def emit(
        self, tokens: list[int], logits: torch.Tensor | None = None, rows: list[int] | None = None
    ) -> int: ...
    def observe(self, side: str, what: str, t0: float, **fields: Any) -> None: ...


def verify_round(job: RoundJob, target: Any, proposal: DraftProposal, bonus: bool = True) -> Verdict:
    """The one verification round of every schedule: score the proposal with p in one pass, then
    `settle` it (accept a path, keep it in p's cache, emit, book).

    `target` is a `hippo.interfaces.ModelSession`; it first consumes the emitted tokens it has not seen
    (the previous round's next token). `bonus=False`: PEARL's post-verify (see the module docstring).
    """
    if not (proposal.chain or job.verifier.trees):  # refused before anything is scored
        raise UnsupportedError(
            f"verifier {type(job.verifier).__name__} verifies chains only, but the drafter made a token "
            "tree; use a stock verifier ('greedy', 'rejection') or leave the verifier unset"
        )
    t0 = time.perf_counter()
    prefix = job.prefix()  # [T]
    logits = target.score_proposal(prefix, proposal)  # [n+1, V] raw p: at the root, then after each node
    verdict, kept = settle(
        job, proposal, logits, lambda path: target.keep_path(prefix.shape[0], proposal, path), bonus
    )
    a, depth = verdict.n_accepted, proposal.depth
    job.observe("target", "verify", t0, pos=prefix.shape[0], n=proposal.size, depth=depth, accepted=a,
                rejected=depth - a, emitted=kept)  # fmt: skip
    return verdict


def settle(
    job: RoundJob,
    proposal: DraftProposal,
    logits: torch.Tensor,  # [n+1, V] raw p after the prefix and after each node (`score_proposal`)
    keep: Callable[[tuple[int, ...]], None],  # keeps the prefix and the accepted path in p's cache
    bonus: bool = True,
) -> tuple[Verdict, int]:
    """Accept a path with the verifier's rule, keep it, emit it and its next token, book the round;
    returns the verdict and the tokens emitted. A batch (`hippo.engine`) settles each row with it."""
    prefix = job.prefix()  # [T]
    scores = process_rows(job.policy, prefix, proposal, logits)  # [n+1, V]
    verdict = job.verifier.verify(proposal, scores, job.policy)
    if not bonus and list(verdict.path) == proposal.spine():  # the draft's continuation is checked next
        verdict = Verdict(verdict.path, None)
    keep(verdict.path)
    nxt = [] if verdict.next_token is None else [verdict.next_token]
    # each emitted token's row of p's logits: the root, then after each accepted node
    rows = [0, *(c + 1 for c in verdict.path)]
    kept = job.emit([*proposal.tokens[list(verdict.path)].tolist(), *nxt], logits, rows)
    # `kept` < accepted + 1 only in the last round (token budget or EOS reached)
    job.stats.record_round(proposal.size, verdict.n_accepted, kept, verdict.n_accepted < proposal.depth)
    return verdict, kept


def process_rows(
    policy: TokenPolicy,
    prefix: torch.Tensor,  # [T]
    proposal: DraftProposal,
    logits: torch.Tensor,  # [n+1, V] raw target logits, as `ModelSession.score_proposal` returns them
) -> torch.Tensor:  # [n+1, V]
    """Each row through the policy's logits processors, with the sequence that row conditions on."""
    if proposal.chain or not policy.processors:  # row i conditions on prefix + tokens[:i]
        seq = torch.cat([prefix, proposal.tokens.cpu()])[: prefix.shape[0] + logits.shape[0] - 1]
        return policy.process(seq, logits)
    tokens = proposal.tokens.cpu()
    seqs = [prefix] + [torch.cat([prefix, tokens[proposal.path(i)]]) for i in range(proposal.size)]
    return torch.cat([policy.process(s, r[None]) for s, r in zip(seqs, logits)])
