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
from collections.abc import Callable, Sequence
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
    """Accept a path with the verifier's rule (`decide`), then `commit` it; returns the verdict and
    the tokens emitted. A batch (`hippo.engine`) decides all its rows in one call, then commits each."""
    scores = process_rows(job.policy, job.prefix(), proposal, logits)  # [n+1, V]
    verdict = decide(job.verifier, [proposal], scores[None], [job.policy])[0]
    return commit(job, proposal, verdict, keep, bonus, logits=logits)


def commit(
    job: RoundJob,
    proposal: DraftProposal,
    verdict: Verdict,
    keep: Callable[[tuple[int, ...]], None],  # keeps the prefix and the accepted path in p's cache
    bonus: bool = True,
    tokens: Sequence[int] | None = None,  # the proposal's tokens, where the caller has them on the host
    logits: torch.Tensor | None = None,  # [n+1, V] raw p, for the emitted tokens' log-probs if asked
) -> tuple[Verdict, int]:
    """Keep the accepted path in p's cache, emit it and its next token, book the round."""
    if not bonus and list(verdict.path) == proposal.spine():  # the draft's continuation is checked next
        verdict = Verdict(verdict.path, None)
    keep(verdict.path)
    nxt = [] if verdict.next_token is None else [verdict.next_token]
    path = list(verdict.path)
    accepted = [tokens[i] for i in path] if tokens is not None else proposal.tokens[path].tolist()
    # each emitted token's row of p's logits (for its log-prob): the root, then after each accepted node
    kept = job.emit([*accepted, *nxt], logits, [0, *(c + 1 for c in path)])
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
    if not policy.processors:  # nothing reads the sequence: a device's draft tokens stay there
        return policy.process(prefix, logits)
    if proposal.chain:  # row i conditions on prefix + tokens[:i]
        seq = torch.cat([prefix, proposal.tokens.cpu()])[: prefix.shape[0] + logits.shape[0] - 1]
        return policy.process(seq, logits)
    tokens = proposal.tokens.cpu()
    seqs = [prefix] + [torch.cat([prefix, tokens[proposal.path(i)]]) for i in range(proposal.size)]
    return torch.cat([policy.process(s, r[None]) for s, r in zip(seqs, logits)])


# ---- every row's chain at once ------------------------------------------------------------------


def accept_chains(
    tokens: torch.Tensor,  # [B, γ] long: row b's chain in its first sizes[b] entries, then padding
    sizes: torch.Tensor,  # [B] long: each row's draft tokens (0..γ)
    scores: torch.Tensor,  # [B, γ+1, V] processed p scores: position 0 at the root, i+1 after token i
    sample: torch.Tensor | None = None,  # [B] bool: the row samples (None: every row is greedy)
    q: torch.Tensor | None = None,  # [B, γ, V] the laws sampled rows drew their tokens from
    uniforms: torch.Tensor | None = None,  # [B, γ] float64 U(0, 1): each position's ratio test
    races: torch.Tensor | None = None,  # [B, V] float64 Exp(1): the race that draws the next token
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [B] long, next token [B] long
    """Both rules for every row and position in one call, on the device of `scores` (no host read).

    Greedy rows keep the longest prefix equal to p's argmax and then take p's argmax. Sampled rows
    accept token i iff u_i * q_i(x_i) < p_i(x_i) up to the first reject n, then draw the next token
    from norm(max(0, p_n - q_n)) after a reject (p_n where that has no mass) or from p_γ after all:
    the rule of `accept_sampled` on a chain. The draw is an exponential race, argmax_v r(v) / E_v
    with E_v ~ Exp(1), which picks v with probability r(v) / sum(r), as vLLM's sampler draws.
    """
    B, G = tokens.shape
    best = scores.argmax(-1)  # [B, γ+1]
    ok = tokens == best[:, :G]  # [B, γ]
    if sample is not None:
        p = torch.softmax(scores.double(), dim=-1)  # [B, γ+1, V]
        x = tokens.clamp_min(0)[..., None]  # [B, γ, 1]
        passed = uniforms * q.gather(-1, x)[..., 0] < p[:, :G].gather(-1, x)[..., 0]  # [B, γ]
        ok = torch.where(sample[:, None], passed, ok)
    ok &= torch.arange(G, device=tokens.device) < sizes[:, None]
    n = ok.long().cumprod(-1).sum(-1)  # [B] accepted
    nxt = best.gather(1, n[:, None])[:, 0]  # [B] greedy: p's argmax after the accepted tokens
    if sample is not None:
        V = p.shape[-1]
        p_n = p.gather(1, n[:, None, None].expand(B, 1, V))[:, 0]  # [B, V]
        q_n = torch.cat([q, q.new_zeros(B, 1, V)], 1).gather(1, n[:, None, None].expand(B, 1, V))[:, 0]
        r = (p_n - q_n).clamp_min(0)  # [B, V] the residual, unnormalised (the race needs no sum)
        use_p = (n >= sizes) | (r.sum(-1) <= 0)  # [B] the bonus, or a residual without mass (p == q)
        r = torch.where(use_p[:, None], p_n, r)
        drawn = (r / races.clamp_min(torch.finfo(races.dtype).tiny)).argmax(-1)  # [B]
        nxt = torch.where(sample, drawn, nxt)
    return n, nxt


def chain_draws(
    policy: TokenPolicy, gamma: int, vocab: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:  # uniforms [width] float64, races [vocab] float64
    """A sampled row's randomness for one round of `accept_chains`, from its own generator: γ
    uniforms (padded with ones to the batch's `width`, which nothing reads) and V exponentials. A row
    draws the same whatever shares its batch."""
    g = policy.generator
    u = torch.ones(width, dtype=torch.float64)
    u[:gamma] = torch.rand(gamma, generator=g, dtype=torch.float64)
    return u, torch.empty(vocab, dtype=torch.float64).exponential_(generator=g)


def accept_rows(
    proposals: Sequence[DraftProposal],  # B chains, on the host
    scores: torch.Tensor,  # [B, W, V] processed p scores, W >= every chain's size + 1
    policies: Sequence[TokenPolicy],
    greedy: bool = False,  # every row by argmax (the greedy verifier), whatever its policy
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [B], next token [B], on the device of `scores`
    """The stock rule for B chains in one `accept_chains` call: greedy for greedy rows, rejection
    sampling for sampled rows, each sampled row drawing from its own generator."""
    B, W, V = scores.shape
    G, dev = W - 1, scores.device
    tokens = torch.zeros(B, G, dtype=torch.long, device=dev)  # [B, γ]: copied where they are, not read
    for b, prop in enumerate(proposals):
        tokens[b, : prop.size] = prop.tokens.to(dev)
    sizes = torch.tensor([prop.size for prop in proposals])
    sampled = [pol.do_sample and not greedy for pol in policies]
    if not any(sampled):
        return accept_chains(tokens, sizes.to(dev), scores)
    q = torch.zeros(B, G, V, dtype=torch.float64, device=dev)  # [B, γ, V], filled where q's laws are
    uniforms, races = torch.ones(B, G, dtype=torch.float64), torch.ones(B, V, dtype=torch.float64)
    for b, (prop, pol) in enumerate(zip(proposals, policies)):
        if not sampled[b]:
            continue
        n = prop.size
        law = prop.q  # [n, V_q] on the draft's side: copied to the scores' device, never to the host
        q[b, :n] = one_hot(prop.tokens.cpu(), V) if law is None else law[:, :V].to(dev, torch.float64)
        uniforms[b], races[b] = chain_draws(pol, n, V, G)
    return accept_chains(
        tokens, sizes.to(dev), scores, torch.tensor(sampled, device=dev), q,
        uniforms.to(dev), races.to(dev),
    )  # fmt: skip


def one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:  # [n] -> [n, V] float64
    return torch.nn.functional.one_hot(tokens, vocab).double()


def vectorised(verifier: Any) -> Callable | None:
    """The verifier's form for every row's chain at once (`Verifier.verify_chains`), or None: where
    a subclass overrides `verify` below the class that defines `verify_chains` (a planted bug, a
    variant), `verify` is its rule and the round calls it per row."""
    mro = type(verifier).__mro__
    own_verify = next(k for k in mro if "verify" in k.__dict__)
    own_chains = next((k for k in mro if "verify_chains" in k.__dict__), None)
    if own_chains is None or not issubclass(own_chains, own_verify):
        return None
    return verifier.verify_chains


def decide(
    verifier: Any,
    proposals: Sequence[DraftProposal],  # B proposals (chains or trees)
    scores: torch.Tensor,  # [B, W, V] processed p scores; row b's first size + 1 positions are its own
    policies: Sequence[TokenPolicy],
) -> list[Verdict]:
    """Every row's verdict: one vectorised call where the verifier has one and every proposal is a
    chain (one host read for the whole batch), else the verifier's `verify` row by row."""
    return decide_reading(verifier, proposals, scores, policies)[0]


def decide_reading(
    verifier: Any,
    proposals: Sequence[DraftProposal],
    scores: torch.Tensor,  # [B, W, V]
    policies: Sequence[TokenPolicy],
    also: torch.Tensor | None = None,  # [B, K] long on any device: read with the verdicts
) -> tuple[list[Verdict], list[list[int]] | None]:
    """`decide`, and `also` read back in the same read as the verdicts (the round's draft tokens that
    stayed on the device: `hippo.engine` reads them only here, so a round reads the host once)."""
    rule = vectorised(verifier)
    if rule is not None and all(prop.chain for prop in proposals):
        accepted, nxt = rule(proposals, scores, policies)
        both = torch.stack([accepted, nxt], dim=1)  # [B, 2]
        if also is not None:
            both = torch.cat([both, also.to(both.device)], dim=1)  # [B, 2 + K]
        host = both.tolist()  # the batch's one read: its verdicts (and `also`)
        verdicts = [Verdict(tuple(range(r[0])), r[1]) for r in host]
        return verdicts, None if also is None else [r[2:] for r in host]
    verdicts = [
        verifier.verify(prop, scores[b, : prop.size + 1], pol)
        for b, (prop, pol) in enumerate(zip(proposals, policies))
    ]
    return verdicts, None if also is None else also.tolist()
