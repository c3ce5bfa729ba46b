"""The verification rules, exactly, in float64.

- law: for every position, P(accept x) q(x) + P(reject) residual(x) == p(x), in closed form (and the
  planted rules of hippo.testing.planted break it);
- `rejection_verify` implements that rule: replaying its randomness gives the same decision;
- it consumes a fixed amount of randomness whatever it decides (seeded runs stay aligned);
- `greedy_verify`: longest matching prefix, then the target's next argmax.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hippo.testing.strategies import examples
from hippo_plugins.verifiers import greedy_verify, rejection_verify, residual

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
def laws(draw, same_allowed: bool = True, bonus: bool = True):
    """(p [γ+1, V], q [γ, V]); p has only γ rows (no bonus row) when `bonus` is False."""
    V, gamma = draw(vocab, label="V"), draw(gammas, label="γ")
    sparsity = draw(st.sampled_from([0.0, 0.3, 0.6]), label="sparsity")
    p = distributions(gamma + int(bonus), V, draw(seeds, label="p seed"), sparsity)  # [γ(+1), V]
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


@settings(max_examples=examples(5))
@given(st.booleans().flatmap(lambda bonus: laws(bonus=bonus)), seeds, seeds)
def test_rejection_verify_follows_the_rule(law, draft_seed, seed):
    """Replay the generator: accept x_i iff u_i < p_i(x_i)/q_i(x_i); then the residual, or p_γ
    (the bonus), or nothing when p has no bonus row and all γ were accepted."""
    p, q = law
    gamma = q.shape[0]
    x = draw_drafts(q, draft_seed)  # [γ]
    g = torch.Generator().manual_seed(seed)
    n, token = rejection_verify(x, q, p, g)

    replay = torch.Generator().manual_seed(seed)
    u = torch.rand(gamma, generator=replay, dtype=torch.float64)  # [γ]
    ratio = p[torch.arange(gamma), x] / q[torch.arange(gamma), x]  # [γ]
    expected_n = next((i for i in range(gamma) if not u[i] < ratio[i]), gamma)
    if expected_n == gamma and p.shape[0] == gamma:  # no bonus row: nothing drawn
        assert (n, token) == (gamma, None)
        assert torch.equal(g.get_state(), replay.get_state())
        return
    law_next = p[gamma] if expected_n == gamma else residual(p[expected_n], q[expected_n])  # [V]
    expected_token = int(torch.multinomial(law_next, 1, generator=replay))
    assert (n, token) == (expected_n, expected_token)
    assert law_next[token] > 0
    assert torch.equal(g.get_state(), replay.get_state())


@settings(max_examples=examples(3))
@given(vocab, gammas, st.lists(seeds, min_size=2, max_size=4), seeds)
def test_rejection_consumes_fixed_randomness(V, gamma, law_seeds, seed):
    """Whatever the decision, the generator ends in the same state: seeded runs stay reproducible."""
    states, verdicts = [], []
    for s in law_seeds:
        p = distributions(gamma + 1, V, s, 0.3)
        q = distributions(gamma, V, s + 1, 0.3)
        g = torch.Generator().manual_seed(seed)
        verdicts.append(rejection_verify(draw_drafts(q, s), q, p, g))
        states.append(g.get_state())
        g2 = torch.Generator().manual_seed(seed)
        assert rejection_verify(draw_drafts(q, s), q, p, g2) == verdicts[-1]  # same seed, same verdict
    assert all(torch.equal(states[0], st_) for st_ in states[1:])


def test_rejection_accepts_everything_when_q_equals_p_one_hot():
    p = torch.nn.functional.one_hot(torch.tensor([3, 1, 4, 0]), 6).double()  # [γ+1, V]
    n, token = rejection_verify(torch.tensor([3, 1, 4]), p[:3], p, torch.Generator().manual_seed(0))
    assert (n, token) == (3, 0)


def test_rejection_rejects_a_token_p_cannot_emit():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)  # [γ+1, V]
    q = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)  # [γ, V]
    for seed in range(20):
        n, token = rejection_verify(torch.tensor([2]), q, p, torch.Generator().manual_seed(seed))
        assert n == 0 and token in (0, 1)


# ---- greedy -------------------------------------------------------------------------------------


def scores_for(argmaxes: list[int], V: int, seed: int = 0) -> torch.Tensor:  # -> [γ+1, V]
    """Scores whose row-wise argmax is `argmaxes` (noise elsewhere, strictly below the max)."""
    noise = torch.rand(len(argmaxes), V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return noise + 2.0 * torch.nn.functional.one_hot(torch.tensor(argmaxes), V).double()


def test_greedy_all_accepted_gives_the_bonus():
    assert greedy_verify(torch.tensor([4, 2, 7]), scores_for([4, 2, 7, 5], 9)) == (3, 5)


def test_greedy_first_wrong_accepts_nothing():
    assert greedy_verify(torch.tensor([1, 2, 7]), scores_for([4, 2, 7, 5], 9)) == (0, 4)


def test_greedy_stops_at_the_first_mismatch_even_if_later_ones_match():
    assert greedy_verify(torch.tensor([4, 3, 7, 5]), scores_for([4, 2, 7, 5, 0], 9)) == (1, 2)


def test_greedy_without_bonus_row_has_no_next_token_when_all_accepted():
    assert greedy_verify(torch.tensor([4, 2, 7]), scores_for([4, 2, 7], 9)) == (3, None)
    assert greedy_verify(torch.tensor([4, 3, 7]), scores_for([4, 2, 7], 9)) == (1, 2)


def test_greedy_empty_draft_is_one_target_token():
    assert greedy_verify(torch.zeros(0, dtype=torch.long), scores_for([6], 9)) == (0, 6)


@settings(max_examples=examples(5))
@given(st.data())
def test_greedy_is_longest_matching_prefix(data):
    V = data.draw(vocab, label="V")
    gamma = data.draw(gammas, label="γ")
    rows = gamma + (1 if gamma == 0 else data.draw(st.sampled_from([1, 0]), label="bonus row"))
    target = data.draw(st.lists(st.integers(0, V - 1), min_size=rows, max_size=rows), label="argmax")
    draft = data.draw(st.lists(st.integers(0, V - 1), min_size=gamma, max_size=gamma), label="draft")
    expected = next((i for i in range(gamma) if draft[i] != target[i]), gamma)
    got = greedy_verify(torch.tensor(draft, dtype=torch.long), scores_for(target, V, seed=gamma))
    assert got == (expected, target[expected] if expected < rows else None)


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
