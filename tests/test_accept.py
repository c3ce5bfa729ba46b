"""The acceptance rules of `hippo.accept`, exactly, in float64.

- law: for every position, P(accept x) q(x) + P(reject) residual(x) == p(x), in closed form (and the
  planted rules of hippo.testing.planted break it);
- `accept_sampled` implements that rule on chains: replaying its randomness gives the same decision;
- on trees it tests siblings in order against the running residual;
- `accept_greedy`: the longest path equal to p's argmax, then p's next argmax (chains and trees);
- the proposal: a tree without siblings is a chain; its spine, depths, paths and chunks;
- the round refuses a token tree, before scoring it, when the verifier verifies chains only.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

from hippo.accept import accept_greedy, accept_sampled, residual, verify_round
from hippo.errors import UnsupportedError
from hippo.interfaces import Verifier
from hippo.proposal import DraftProposal
from hippo.sampling import TokenPolicy
from hippo.testing.strategies import examples

vocab = st.integers(2, 12)
gammas = st.integers(0, 6)
seeds = st.integers(0, 2**31 - 1)


def distributions(rows: int, V: int, seed: int, sparsity: float) -> torch.Tensor:  # -> [rows, V]
    """Random laws with some exact zeros (never a whole row), to exercise support mismatches."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(rows, V, generator=g, dtype=torch.float64)
    w = w * (torch.rand(rows, V, generator=g, dtype=torch.float64) >= sparsity)
    w[torch.arange(rows), torch.randint(V, (rows,), generator=g)] += 0.1  # one sure token per row
    return w / w.sum(-1, keepdim=True)


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # p, q [V] -> [V]
    """min(1, p(x)/q(x)) where q(x) > 0 (a token with q(x) = 0 is never proposed)."""
    ratio = torch.where(q > 0, p / q.where(q > 0, torch.ones_like(q)), torch.zeros_like(q))
    return ratio.clamp_max(1.0)


@st.composite
def laws(draw, same_allowed: bool = True):
    """(p [γ+1, V], q [γ, V])."""
    V, gamma = draw(vocab, label="V"), draw(gammas, label="γ")
    sparsity = draw(st.sampled_from([0.0, 0.3, 0.6]), label="sparsity")
    p = distributions(gamma + 1, V, draw(seeds, label="p seed"), sparsity)  # [γ+1, V]
    q = distributions(gamma, V, draw(seeds, label="q seed"), sparsity)  # [γ, V]
    if same_allowed and draw(st.booleans(), label="q == p"):
        q = p[:gamma].clone()
    return p, q


# ---- the law, in closed form --------------------------------------------------------------------


@settings(max_examples=examples(5))
@given(laws())
def test_accept_or_residual_reproduces_p(law):
    p, q = law
    for i in range(q.shape[0]):
        a = acceptance(p[i], q[i])  # [V]
        p_reject = float((q[i] * (1 - a)).sum())
        out = q[i] * a + p_reject * residual(p[i], q[i])  # [V] law of the token emitted here
        torch.testing.assert_close(out, p[i], rtol=0, atol=1e-12)


def test_the_closed_form_fails_the_planted_rules():
    """The identity above is not vacuous: the planted bugs of hippo.testing.planted break it (the
    recovered token from p, acceptance min(1, q/p)), by far more than its tolerance."""
    p, q = distributions(1, 6, 3, 0.0)[0], distributions(1, 6, 4, 0.0)[0]  # [V] each
    a = acceptance(p, q)
    reject = float((q * (1 - a)).sum())
    from_p = q * a + reject * p  # the residual taken from p
    upside_down = acceptance(q, p) * q  # accept with min(1, q/p) ...
    upside_down = upside_down + float((q - upside_down).sum()) * residual(p, q)  # ... then the true residual
    for wrong in (from_p, upside_down):
        assert float((wrong - p).abs().sum()) / 2 > 0.01


@settings(max_examples=examples(2))
@given(laws(same_allowed=False))
def test_residual_is_the_normalised_excess_of_p_over_q(law):
    p, q = law
    for i in range(q.shape[0]):
        r = residual(p[i], q[i])  # [V]
        excess = (p[i] - q[i]).clamp_min(0)  # [V]
        assert abs(float(r.sum()) - 1.0) < 1e-12 and bool((r >= 0).all())
        if excess.sum() > 0:
            torch.testing.assert_close(r, excess / excess.sum(), rtol=0, atol=1e-15)
        else:  # p <= q everywhere means p == q: the residual is never used, p is the fallback
            torch.testing.assert_close(r, p[i], rtol=0, atol=0)


# ---- the implementation follows the rule ---------------------------------------------------------


def draw_drafts(q: torch.Tensor, seed: int) -> torch.Tensor:  # q [γ, V] -> x [γ], x_i ~ q_i
    if q.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.multinomial(q, 1, generator=torch.Generator().manual_seed(seed))[:, 0]


def sampled(x: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, g: torch.Generator) -> tuple:
    """accept_sampled on a chain, as (accepted count, next token)."""
    v = accept_sampled(DraftProposal(tokens=x, q=q), p, g)
    assert v.path == tuple(range(v.n_accepted))
    return v.n_accepted, v.next_token


@settings(max_examples=examples(5))
@given(laws(), seeds, seeds)
def test_accept_sampled_follows_the_rule(law, draft_seed, seed):
    """Replay the generator: accept x_i iff u_i < p_i(x_i)/q_i(x_i), one uniform per token tested;
    then the residual after a reject, or p_γ (the bonus) after all γ."""
    p, q = law
    gamma = q.shape[0]
    x = draw_drafts(q, draft_seed)  # [γ]
    g = torch.Generator().manual_seed(seed)
    n, token = sampled(x, q, p, g)

    replay = torch.Generator().manual_seed(seed)
    expected_n = gamma
    for i in range(gamma):
        u = float(torch.rand((), generator=replay, dtype=torch.float64))
        if not u < float(p[i, x[i]] / q[i, x[i]]):
            expected_n = i
            break
    law_next = p[gamma] if expected_n == gamma else residual(p[expected_n], q[expected_n])  # [V]
    expected_token = int(torch.multinomial(law_next, 1, generator=replay))
    assert (n, token) == (expected_n, expected_token)
    assert law_next[token] > 0
    assert torch.equal(g.get_state(), replay.get_state())
    assert sampled(x, q, p, torch.Generator().manual_seed(seed)) == (n, token)  # same seed, same verdict


def test_accept_sampled_accepts_everything_when_q_equals_p_one_hot():
    p = torch.nn.functional.one_hot(torch.tensor([3, 1, 4, 0]), 6).double()  # [γ+1, V]
    x = torch.tensor([3, 1, 4])
    assert sampled(x, p[:3], p, torch.Generator().manual_seed(0)) == (3, 0)
    assert sampled(x, None, p, torch.Generator().manual_seed(0)) == (3, 0)  # q None: one-hot drafts


def test_accept_sampled_rejects_a_token_p_cannot_emit():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)  # [γ+1, V]
    q = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)  # [γ, V]
    for seed in range(20):
        for law in (q, None):
            n, token = sampled(torch.tensor([2]), law, p, torch.Generator().manual_seed(seed))
            assert n == 0 and token in (0, 1)


def test_accept_sampled_tests_siblings_against_the_running_residual():
    """Root children 0, 1 (tokens 2 then 0); child 0 is impossible under p, so it is always rejected
    and child 1 is tested against norm(max(0, p_0 - q_0)); p_0 = (0.5, 0.5, 0) and q_0 one-hot on 2
    leave r = p_0, so token 0 is accepted with r(0)/q_1(0) = 0.5 / 1."""
    tree = DraftProposal(
        tokens=torch.tensor([2, 0]),
        q=torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64),  # [n, V]
        parents=torch.tensor([-1, -1]),
    )
    p = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.1, 0.8], [0.0, 1.0, 0.0]], dtype=torch.float64)  # [n+1, V]
    got = [accept_sampled(tree, p, torch.Generator().manual_seed(s)) for s in range(400)]
    accepted = [v for v in got if v.path]
    assert all(v.path == (1,) and v.next_token == 1 for v in accepted)  # then the bonus from p after node 1
    assert all(v.next_token == 1 for v in got if not v.path)  # the residual after both: (0, 1, 0)
    assert 150 < len(accepted) < 250  # P(accept child 1) = 1/2


# ---- greedy -------------------------------------------------------------------------------------


def scores_for(argmaxes: list[int], V: int, seed: int = 0) -> torch.Tensor:  # -> [n+1, V]
    """Scores whose row-wise argmax is `argmaxes` (noise elsewhere, strictly below the max)."""
    noise = torch.rand(len(argmaxes), V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return noise + 2.0 * torch.nn.functional.one_hot(torch.tensor(argmaxes), V).double()


def greedy(draft: list[int], argmaxes: list[int], V: int = 9, seed: int = 0) -> tuple:
    v = accept_greedy(
        DraftProposal(tokens=torch.tensor(draft, dtype=torch.long)), scores_for(argmaxes, V, seed)
    )
    return v.n_accepted, v.next_token


def test_greedy_all_accepted_gives_the_bonus():
    assert greedy([4, 2, 7], [4, 2, 7, 5]) == (3, 5)


def test_greedy_first_wrong_accepts_nothing():
    assert greedy([1, 2, 7], [4, 2, 7, 5]) == (0, 4)


def test_greedy_stops_at_the_first_mismatch_even_if_later_ones_match():
    assert greedy([4, 3, 7, 5], [4, 2, 7, 5, 0]) == (1, 2)


def test_greedy_empty_draft_is_one_target_token():
    assert greedy([], [6]) == (0, 6)


@settings(max_examples=examples(5))
@given(st.data())
def test_greedy_is_longest_matching_prefix(data):
    V = data.draw(vocab, label="V")
    gamma = data.draw(gammas, label="γ")
    target = data.draw(
        st.lists(st.integers(0, V - 1), min_size=gamma + 1, max_size=gamma + 1), label="argmax"
    )
    draft = data.draw(st.lists(st.integers(0, V - 1), min_size=gamma, max_size=gamma), label="draft")
    expected = next((i for i in range(gamma) if draft[i] != target[i]), gamma)
    assert greedy(draft, target, V, seed=gamma) == (expected, target[expected])


def test_greedy_on_a_tree_takes_the_matching_branch():
    """Root children 0 (token 5) and 1 (token 4); node 2 (token 7) below node 1, node 3 (token 1) below 0.
    p's argmax: 4 at the root, 7 after node 1, 3 after node 2: path (1, 2), then 3."""
    tree = DraftProposal(tokens=torch.tensor([5, 4, 7, 1]), parents=torch.tensor([-1, -1, 1, 0]))
    scores = scores_for([4, 0, 7, 3, 0], 9)  # rows: root, after node 0, 1, 2, 3
    v = accept_greedy(tree, scores)
    assert (v.path, v.next_token) == ((1, 2), 3)
    assert tree.spine() == [0, 3] and tree.depth == 2 and tree.path(2) == [1, 2]


def test_a_tree_without_siblings_is_a_chain():
    chain = DraftProposal(tokens=torch.tensor([3, 1, 4]), parents=torch.tensor([-1, 0, 1]))
    assert chain.chain and chain.parents is None and chain.spine() == [0, 1, 2] and chain.depth == 3
    assert [c.tokens.tolist() for c in chain.chunks(2)] == [[3, 1], [4]]
    tree = DraftProposal(tokens=torch.tensor([3, 1, 4]), parents=torch.tensor([-1, 0, 0]))
    assert not tree.chain and tree.chunks(1) == [tree] and tree.spine_tokens().tolist() == [3, 1]
    assert tree.truncate(2).chain  # nodes 0 and 1 alone form a chain


# ---- the law check's statistics (hippo.testing.power) ---------------------------------------------


def test_the_power_bound_holds_in_simulation():
    """Every law at TV ε from P that moves mass ε onto one set of cells in proportion to P (the hardest
    direction for that set) is rejected at least as often as `worst_power` says, and an exact sampler's
    counts are not rejected; multinomial counts simulated, 2000 each."""
    from hippo.testing import power as pw

    probs, n, alpha, eps = [0.9, 0.07, 0.03, 0.0], 600, 1e-3, 0.05
    bound = pw.worst_power(probs, n, alpha, eps)
    assert 0.3 < bound < 1.0
    g = torch.Generator().manual_seed(0)

    def rate(law: list[float]) -> float:
        counts = torch.multinomial(torch.tensor(law), n * 2000, replacement=True, generator=g).view(2000, n)
        hits = [
            bool(pw.rejections(torch.bincount(c, minlength=len(law)).tolist(), probs, alpha)) for c in counts
        ]
        return sum(hits) / len(hits)

    assert rate(probs[:3] + [1e-300]) == 0.0
    for s in pw.sets(len(probs)):
        a = sum(probs[i] for i in s)
        for sign in (1, -1):
            if not 0 < a < 1 or not 0 <= a + sign * eps <= 1:
                continue
            inside, outside = (a + sign * eps) / a, (1 - a - sign * eps) / (1 - a)
            law = [p * (inside if i in s else outside) for i, p in enumerate(probs)]
            assert rate(law) >= bound - 0.03, (s, sign)


def test_a_chains_only_verifier_refuses_a_token_tree_before_scoring():
    class ChainsOnly(Verifier):
        def verify(self, proposal, p_scores, policy):
            raise AssertionError("never reached")

    class Job:
        verifier = ChainsOnly()

        def prefix(self):
            raise AssertionError("the round must refuse before it reads the prefix")

    with pytest.raises(AssertionError, match="must refuse before"):  # a chain gets past the refusal
        verify_round(Job(), None, DraftProposal(tokens=torch.tensor([4, 5])))
    tree = DraftProposal(tokens=torch.tensor([4, 5]), parents=torch.tensor([-1, -1]))
    with pytest.raises(UnsupportedError, match="ChainsOnly verifies chains only"):
        verify_round(Job(), None, tree)


def test_a_policy_applies_its_processors_as_their_list_does():
    """`TokenPolicy.process` runs the processors itself (the list inspects each one's signature per
    call): the same scores row by row, and the list's own call where a processor wants more."""

    class WantsMore(LogitsProcessor):
        def __call__(self, input_ids, scores, extra):
            return scores

    plain = LogitsProcessorList(
        [
            MinNewTokensLengthLogitsProcessor(4, 6, 2),
            RepetitionPenaltyLogitsProcessor(1.3),
            TemperatureLogitsWarper(0.7),
        ]
    )
    seq, logits = (
        torch.tensor([5, 1, 7, 7, 3, 9]),
        torch.randn(3, 12, generator=torch.Generator().manual_seed(0)),
    )
    expected = torch.cat([plain(seq[None, : 4 + i], logits[i : i + 1].clone()) for i in range(3)])
    policy = TokenPolicy(plain, True, torch.Generator())
    assert torch.equal(policy.process(seq, logits), expected)
    assert torch.equal(pickle.loads(pickle.dumps(policy.fork())).process(seq, logits), expected)
    with pytest.raises(ValueError, match="extra"):
        TokenPolicy(LogitsProcessorList([WantsMore()]), False, torch.Generator()).process(seq, logits)


@settings(max_examples=examples(2), deadline=None)
@given(
    n=st.integers(1, 2500),
    p=st.sampled_from([0.0, 1.0, 0.5, 0.898, 0.102, 1e-6]) | st.floats(0.0, 1.0),
    alpha=st.sampled_from([1e-7, 4e-5, 1e-3, 0.05]),
)
def test_the_batched_tails_are_the_tails_of_each_pmf(n, p, alpha):
    """`worst_power` tests every set at once (`thresholds_of`, `reject_probabilities`); each row is the
    exact test of its own pmf: lo the last k with P(O <= k) <= alpha / 2, hi the first with
    P(O >= k) <= alpha / 2, and the rejection probability their tails' mass."""
    from hippo.testing import power as pw

    pmf = pw.binomial_pmf(n, p)  # [n + 1]
    assert abs(float(pmf.sum()) - 1.0) < 1e-9
    lower, upper = torch.cumsum(pmf, 0), torch.flip(torch.cumsum(torch.flip(pmf, [0]), 0), [0])
    below = [k for k in range(n + 1) if lower[k] <= alpha / 2]
    above = [k for k in range(n + 1) if upper[k] <= alpha / 2]
    lo, hi = (below[-1] if below else -1), (above[0] if above else n + 1)
    assert pw.thresholds.__wrapped__(n, p, alpha) == (lo, hi)
    q = min(1.0, p + 0.05)
    reject = float(pw.binomial_pmf(n, q)[: lo + 1].sum() + pw.binomial_pmf(n, q)[hi:].sum())
    both = pw.reject_probabilities(n, [p, 0.5], [q, 0.5], alpha)  # [2]: the row of p, beside another
    assert abs(float(both[0]) - reject) < 1e-12


def test_after_re_roots_a_continuation_at_the_token_p_emitted() -> None:
    """`DraftProposal.after`: what a continuation drafted beside p keeps once p emitted `token` where
    it starts: a chain's rest; a tree's subtree under the root child that drafted `token`."""
    import torch

    from hippo.proposal import DraftProposal

    chain = DraftProposal(tokens=torch.tensor([7, 8, 9]), q=torch.eye(10)[[7, 8, 9]])
    rest = chain.after(7)
    assert rest.tokens.tolist() == [8, 9] and rest.chain and torch.equal(rest.q, torch.eye(10)[[8, 9]])
    assert chain.after(6) is None and DraftProposal(tokens=torch.tensor([7])).after(7) is None
    # root children 0 (token 5) and 1 (token 6); 2 under 0, 3 and 4 under 1, 5 under 3
    tree = DraftProposal(tokens=torch.tensor([5, 6, 1, 2, 3, 4]), parents=torch.tensor([-1, -1, 0, 1, 1, 3]))
    sub = tree.after(6)
    assert sub.tokens.tolist() == [2, 3, 4] and sub.parent_list() == [-1, -1, 0] and sub.depth == 2
    assert tree.after(5).tokens.tolist() == [1] and tree.after(5).chain
    assert tree.after(1) is None  # not drafted at the first position
