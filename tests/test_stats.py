"""Stats bookkeeping: the two MAT figures."""

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
