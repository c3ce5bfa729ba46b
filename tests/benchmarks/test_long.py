"""`hippo bench --long`'s bookkeeping: the target alone measured before and after the other rows, the
others in the table's order at one N and reversed at the next, and every speedup taken over the
mean of the target alone's two runs."""

from __future__ import annotations

import pytest
import torch

from hippo.benchmarks.long import Clip, Row, _rows_at, bracket, row_order


def _one(seconds: float, decode: float, seq: list[int]) -> dict:
    return {
        "seq": seq,
        "seconds": seconds,
        "decode_seconds": decode,
        "ttft": seconds - decode,
        "stats": {"seconds_target_decode": decode, "new_tokens": len(seq)},
        "kept": None,
        "peak": 0,
        "extra": 0,
    }


def _four(seconds: float, decode: float, seq: list[int]) -> dict:
    return {
        "seqs": [seq] * 4,
        "seconds": seconds,
        "prepare_seconds": seconds - decode,
        "decode_seconds": decode,
        "mat": 1.0,
        "peak": 0,
        "extra": 0,
    }


def test_the_target_alone_is_the_mean_of_its_runs_before_and_after_the_rows() -> None:
    seq = [5, 6, 7]
    first = (_one(12.0, 4.0, seq), _four(30.0, 10.0, seq))
    last = (_one(8.0, 2.0, seq), _four(20.0, 8.0, seq))
    (one, four), drift = bracket(first, last)
    assert (one["seconds"], one["decode_seconds"], one["ttft"]) == (10.0, 3.0, 7.0)
    assert (four["seconds"], four["decode_seconds"], four["prepare_seconds"]) == (25.0, 9.0, 16.0)
    assert drift == pytest.approx((8.0 / 12.0, 20.0 / 30.0))

    clip = Clip(576, {}, torch.zeros(0, dtype=torch.long), torch.zeros(0), "")
    step = {"decode_over_bound": 2.0, "verify_over_bound": 3.0}
    # HF generate's four cold questions are left out of --quick: its row has one workload only
    results = {"target_alone": (one, four), "hf_generate": (_one(5.0, 1.5, seq), None)}
    rows = _rows_at(clip, [Row("target_alone"), Row("hf_generate")], results, step)
    assert [(r["method"], r["workload"]) for r in rows] == [
        ("target_alone", "one_question"),
        ("target_alone", "four_questions"),
        ("hf_generate", "one_question"),
    ]
    assert rows[0]["e2e_speedup"] == 1.0 and rows[1]["decode_speedup"] == 1.0
    assert rows[2]["e2e_speedup"] == pytest.approx(10.0 / 5.0)
    assert rows[2]["decode_speedup"] == pytest.approx(3.0 / 1.5)
    assert all(r["identical"] for r in rows)


def test_the_rows_run_between_two_runs_of_the_target_alone_in_alternating_order() -> None:
    table = [
        Row("target_alone"),
        Row("hf_generate"),
        Row("serial", "uniform", 0.1),
        Row("auto", "holistic", 0.1),
    ]
    first, second, third = (row_order(table, i) for i in range(3))
    assert first == [*table, table[0]] and third == first
    assert second == [table[0], *table[:0:-1], table[0]]
    with pytest.raises(ValueError, match="starts with the target alone"):
        row_order(table[1:], 0)
