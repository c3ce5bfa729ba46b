"""Stats bookkeeping: the two MAT figures, and the draft time hidden behind the target."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hippo.types import Stats


def test_mat_per_round_and_accumulated_over_full_acceptances() -> None:
    s = Stats(new_tokens=22)
    # γ = 5: two full rounds with bonus, a reject after 2, a reject at once, a full round without bonus
    for accepted, emitted, rejected in (
        (5, 6, False),
        (5, 6, False),
        (2, 3, True),
        (0, 1, True),
        (5, 5, False),
    ):
        s.record_round(5, accepted, emitted, rejected)
    assert s.rounds == 5 and s.accepted_per_round == [5, 5, 2, 0, 5]
    assert s.mat == 21 / 5  # tokens per verification
    assert s.mat_accumulated == 21 / 3  # runs 6+6+3, 1, 5: a full round does not end a run
    assert s.as_dict()["mat_accumulated"] == 7.0


def test_mat_without_rounds() -> None:
    assert Stats(new_tokens=4).mat == Stats(new_tokens=4).mat_accumulated == 1.0
    assert Stats().mat == 0.0


def _disjoint(draw_floats: list[float]) -> list[tuple[float, float]]:
    """Disjoint [start, end) intervals from sorted cut points, every other gap kept."""
    cuts = sorted(draw_floats)
    return [(cuts[k], cuts[k + 1]) for k in range(0, len(cuts) - 1, 2)]


@given(
    st.lists(st.floats(0, 100, allow_nan=False), max_size=40),
    st.lists(st.floats(0, 100, allow_nan=False), max_size=40),
    st.randoms(use_true_random=False),
)
def test_hidden_draft_time_is_the_overlap_of_the_two_sides_busy_spans(xs, ys, rnd) -> None:
    """`overlap_seconds` (the draft time hidden behind the target's, one sweep) equals the sum over
    every pair of spans of their intersection, whatever order the spans come in."""
    from hippo.executor import overlap_seconds

    a, b = _disjoint(xs), _disjoint(ys)
    pairs = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)
    rnd.shuffle(a)
    assert overlap_seconds(a, b) == pytest.approx(pairs, abs=1e-9)
    assert overlap_seconds(b, a) == pytest.approx(pairs, abs=1e-9)
