"""Every row's chain in one call (`hippo.accept.accept_chains`, `accept_rows`, `decide`), in float64.

- greedy rows: each row's verdict is `accept_greedy`'s on that row alone, whatever its batch-mates,
  its draft length and which of its draft tokens are wrong;
- sampled rows: replaying the draws gives the rule of `accept_sampled` on each row (accept x_i iff
  u_i q_i(x_i) < p_i(x_i), then the residual after a reject or p_γ after all), greedy and sampled
  rows mixed in one batch;
- the law: rounds of `accept_rows` on a Markov target emit sequences distributed exactly as the
  target's own, at a stated power against every law at total variation 5%;
- `decide` takes the vectorised form only where the class that defines `verify` defines it too, so a
  subclass that changes the rule (a planted bug) is verified row by row with its own `verify`.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hippo.accept import accept_chains, accept_greedy, accept_rows, chain_draws, decide, residual, vectorised
from hippo.proposal import DraftProposal
from hippo.registry import lookup
from hippo.sampling import TokenPolicy
from hippo.testing import power as pw
from hippo.testing.strategies import examples

seeds = st.integers(0, 2**31 - 1)


@st.composite
def batches(draw):
    """(scores [B, γ+1, V], tokens [B, γ], sizes [B]): some draft tokens equal p's argmax, some not."""
    B, G, V = draw(st.integers(1, 5), label="B"), draw(st.integers(0, 6), label="γ"), draw(st.integers(2, 9))
    g = torch.Generator().manual_seed(draw(seeds, label="seed"))
    scores = torch.randn(B, G + 1, V, generator=g, dtype=torch.float64)
    best = scores.argmax(-1)  # [B, γ+1]
    wrong = torch.tensor(
        draw(st.lists(st.booleans(), min_size=B * G, max_size=B * G), label="wrong"), dtype=torch.bool
    )
    other = (best[:, :G] + 1 + torch.randint(V - 1, (B, G), generator=g)) % V  # != argmax
    tokens = torch.where(wrong.view(B, G), other, best[:, :G])
    sizes = torch.tensor(draw(st.lists(st.integers(0, G), min_size=B, max_size=B), label="sizes"))
    return scores, tokens, sizes


@settings(max_examples=examples(20))
@given(batches())
def test_greedy_rows_are_each_rows_accept_greedy(batch):
    scores, tokens, sizes = batch
    n, nxt = accept_chains(tokens, sizes, scores)
    for b in range(tokens.shape[0]):
        alone = accept_greedy(DraftProposal(tokens=tokens[b, : sizes[b]]), scores[b, : sizes[b] + 1])
        assert (int(n[b]), int(nxt[b])) == (alone.n_accepted, alone.next_token)


def replay(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, u: torch.Tensor, races: torch.Tensor) -> tuple:
    """The rule on one row, written out: p [n+1, V], q [n, V], x [n], u [n], races [V]."""
    for i in range(x.shape[0]):
        if not float(u[i] * q[i, x[i]]) < float(p[i, x[i]]):
            law = residual(p[i], q[i])
            return i, int((law / races).argmax())
    return x.shape[0], int((p[x.shape[0]] / races).argmax())


@settings(max_examples=examples(20))
@given(batches(), seeds, st.lists(st.booleans(), min_size=5, max_size=5))
def test_sampled_rows_follow_the_rule_beside_greedy_rows(batch, seed, sampled):
    scores, _, sizes = batch
    B, W, V = scores.shape
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(B, W - 1, V, generator=g, dtype=torch.float64) * 2, -1)  # [B, γ, V]
    x = torch.stack([torch.multinomial(q[b], 1, generator=g)[:, 0] for b in range(B)]) if W > 1 else (
        torch.zeros(B, 0, dtype=torch.long))  # fmt: skip
    proposals = [DraftProposal(tokens=x[b, : sizes[b]], q=q[b, : sizes[b]]) for b in range(B)]
    policies = [TokenPolicy([], sampled[b], torch.Generator().manual_seed(seed + b)) for b in range(B)]
    n, nxt = accept_rows(proposals, scores, policies)
    p = torch.softmax(scores, -1)
    for b in range(B):
        if not sampled[b]:
            alone = accept_greedy(proposals[b], scores[b, : sizes[b] + 1])
            assert (int(n[b]), int(nxt[b])) == (alone.n_accepted, alone.next_token)
            continue
        u, races = chain_draws(
            TokenPolicy([], True, torch.Generator().manual_seed(seed + b)), int(sizes[b]), V, W - 1
        )
        want = replay(p[b, : sizes[b] + 1], q[b, : sizes[b]], x[b, : sizes[b]], u, races)
        assert (int(n[b]), int(nxt[b])) == want


def test_rounds_emit_the_targets_law():
    """A Markov target P (V = 3, first law p0) and a draft Q that disagrees with it: rows decode 3
    tokens in rounds of γ = 2 through `accept_rows`, all rows in one call per round; the first three
    tokens' law is p0(a) P[a, b] P[b, c], checked at the harness's level and power."""
    V, runs = 3, 6000
    g = torch.Generator().manual_seed(7)
    p0 = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    P = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.3, 0.5, 0.2]], dtype=torch.float64)
    q0 = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    Q = torch.tensor([[0.2, 0.7, 0.1], [0.5, 0.4, 0.1], [0.1, 0.1, 0.8]], dtype=torch.float64)
    law = {(a, b, c): float(p0[a] * P[a, b] * P[b, c]) for a, b, c in itertools.product(range(V), repeat=3)}
    groups = pw.cells(law)
    probs = pw.cell_probs(law, groups)
    power = pw.worst_power(probs, runs, pw.ALPHA)
    assert power >= pw.POWER, power
    emitted: list[list[int]] = [[] for _ in range(runs)]
    policies = [TokenPolicy([], True, torch.Generator().manual_seed(1000 + r)) for r in range(runs)]
    while any(len(e) < 3 for e in emitted):
        live = [r for r in range(runs) if len(emitted[r]) < 3]
        proposals, scores = [], torch.zeros(len(live), 3, V, dtype=torch.float64)
        for i, r in enumerate(live):
            first = p0 if not emitted[r] else P[emitted[r][-1]]  # p after the emitted prefix
            draft_first = q0 if not emitted[r] else Q[emitted[r][-1]]
            x0 = int(torch.multinomial(draft_first, 1, generator=g))
            x1 = int(torch.multinomial(Q[x0], 1, generator=g))
            proposals.append(
                DraftProposal(tokens=torch.tensor([x0, x1]), q=torch.stack([draft_first, Q[x0]]))
            )
            scores[i] = torch.stack([first, P[x0], P[x1]]).log()  # [γ+1, V]
        n, nxt = accept_rows(proposals, scores, [policies[r] for r in live])
        for i, r in enumerate(live):
            emitted[r] += [*proposals[i].tokens[: int(n[i])].tolist(), int(nxt[i])]
    index = {k: j for j, group in enumerate(groups) for k in group}
    counts = [0] * len(groups)
    for e in emitted:
        counts[index[tuple(e[:3])]] += 1
    assert not pw.rejections(counts, probs, pw.ALPHA)
    # the same check sees a rule that draws the recovered token from p instead of the residual
    assert pw.rejections(
        [round(runs * x) for x in pw.cell_probs(_from_p(p0, P, q0, Q), groups)], probs, pw.ALPHA
    )


def _from_p(p0, P, q0, Q) -> dict:
    """The first three tokens' law when a reject's token is drawn from p (a planted bug), γ = 2 rounds
    from the start, as an exact sum over the first round's drafts; later tokens from P (enough to
    move the law's first token)."""
    V = p0.shape[0]
    first = torch.zeros(V, dtype=torch.float64)
    for x0 in range(V):
        a = min(1.0, float(p0[x0] / q0[x0]))
        first[x0] += q0[x0] * a
        first += q0[x0] * (1 - a) * p0
    return {
        (a, b, c): float(first[a] * P[a, b] * P[b, c]) for a, b, c in itertools.product(range(V), repeat=3)
    }


def test_decide_uses_the_vectorised_rule_only_where_the_rule_is_its_own():
    Rejection, Tree = lookup("verifiers", "rejection"), lookup("verifiers", "tree")
    assert vectorised(Rejection()) is not None and vectorised(Tree()) is not None

    class Planted(Tree):  # overrides the rule, not its vectorised form: verified row by row
        calls = 0

        def verify(self, proposal, p_scores, policy):
            Planted.calls += 1
            return super().verify(proposal, p_scores, policy)

    assert vectorised(Planted()) is None
    scores = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    props = [DraftProposal(tokens=torch.tensor([1, 2])), DraftProposal(tokens=torch.tensor([3]))]
    policies = [TokenPolicy([], False, torch.Generator()) for _ in props]
    assert decide(Planted(), props, scores, policies) == decide(Tree(), props, scores, policies)
    assert Planted.calls == 2
