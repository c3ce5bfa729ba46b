"""`hippo bench --long`'s bookkeeping: the target alone measured before and after the other rows, the
others in the table's order at one N and reversed at the next, and every speedup taken over the
mean of the target alone's two runs."""

from __future__ import annotations

import re

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


def test_the_projection_scales_table_2_with_n_and_charges_the_measured_rounds() -> None:
    from hippo.benchmarks.projection import COSTS, PAPER_N, long_costs, long_projection

    n0 = PAPER_N[0]
    at_n0 = long_costs(n0, 0.1, n0)
    assert at_n0 == pytest.approx(COSTS)  # Table 2's own N: Table 2's costs
    small, large = long_costs(2048, 0.1, n0), long_costs(16384, 0.1, n0)
    for k in COSTS:
        assert small[k] < at_n0[k] < large[k]
    # prefill: linear plus a small attention term; a forward: weights dominate, the KV adds a few %
    assert 2.0 < long_costs(2 * n0, 0.1, n0)["target_prefill"] / COSTS["target_prefill"] < 2.3
    assert 1.0 < long_costs(2 * n0, 0.1, n0)["target_forward"] / COSTS["target_forward"] < 1.05
    assert long_costs(n0, 1.0, n0)["draft_prefill"] > at_n0["draft_prefill"]  # an unpruned draft

    tokens = 12
    alone = long_projection("target_alone", [{"new_tokens": tokens}], 8192, 1.0)
    assert alone["speedup"] == pytest.approx([1.0, 1.0]) and "projection" in alone["label"]
    perfect = {"new_tokens": tokens, "rounds": 2, "drafted_per_round": [5, 5], "emitted_per_round": [6, 6]}
    poor = {**perfect, "rounds": tokens, "drafted_per_round": [5] * tokens, "emitted_per_round": [1] * tokens}
    for method in ("serial", "hippo"):
        good, bad = (long_projection(method, [s], 8192, 0.1) for s in (perfect, poor))
        lo, hi = good["speedup"]
        assert 1.0 < lo <= hi and bad["speedup"][1] < lo
        assert good["seconds"][0] <= good["seconds"][1] and good["paper_n0"] == list(PAPER_N)
    # parallel hides the draft: never slower than serial on the same rounds
    assert (
        long_projection("hippo", [poor], 8192, 0.1)["seconds"][0]
        <= (long_projection("serial", [poor], 8192, 0.1)["seconds"][0])
    )
    # a prepared video's four answers share one prefill; HF generate's four cold ones pay four
    four = long_projection("target_alone", [{"new_tokens": tokens}] * 4, 8192, 1.0)
    cold = long_projection("hf_generate", [{"new_tokens": tokens}] * 4, 8192, 1.0)
    assert cold["seconds"][0] > four["seconds"][0] and cold["speedup"][1] < 1.0


def test_auto_rows_report_the_keep_ratio_they_used() -> None:
    from hippo.benchmarks.long import keep_used

    asks = [{"plan": {"keep": {"ratio": r}}} for r in (0.25, 0.1, 0.1, 0.05)]
    assert keep_used(Row("auto", "holistic", 0.1), asks) == [0.25, 0.1, 0.1, 0.05]
    assert keep_used(Row("auto", "holistic", 0.1), asks[:1]) == 0.25
    assert keep_used(Row("auto", "holistic", 0.1), [{"plan": {}}]) == 0.1  # planner off: the selector's
    assert keep_used(Row("serial", "uniform", 0.1), [{}] * 4) == [0.1] * 4
    assert keep_used(Row("serial", "full"), [{}]) == 1.0
    assert keep_used(Row("target_alone"), [{}]) is None
    alone = {"plan": {"schedule": "autoregressive", "keep": {"ratio": 0.1}}}  # auto gave the target alone
    assert keep_used(Row("auto", "holistic", 0.1), [alone, *asks[1:]]) == [None, 0.1, 0.1, 0.05]
    assert keep_used(Row("auto", "holistic", 0.1), [alone]) is None


@pytest.mark.slow
def test_the_long_bench_runs_on_tiny_settings_with_four_different_questions(monkeypatch, tmp_path) -> None:
    """`hippo bench --long`'s run on the committed pair, one short N and a few rows: four different
    questions per prepared video, every output identical to the target's, `keep_ratio_used` on the
    `auto` rows and a `projected_e2e` on every row. Its section of a report (`--out FILE.md`) opens
    with what was run, for how long and on what, so a re-run keeps that line."""
    from hippo.benchmarks import long
    from hippo.cli.pair.lists import QUESTIONS

    few = [
        Row("target_alone"),
        Row("hf_generate"),
        Row("serial", "full"),
        Row("serial", "uniform", 0.1),
        Row("auto", "holistic", 0.1),
    ]
    monkeypatch.setattr(long, "rows", lambda keep_ratios: few)
    monkeypatch.setattr(long, "claims", lambda *a, **k: {})
    monkeypatch.chdir(tmp_path)
    report = tmp_path / "RESULTS.md"
    report.write_text("# hippo bench results\n\nThe short-video report.\n")
    summary = long.main(
        out=report,
        sweep=(576,),
        keep_ratios=(0.1,),
        max_new_tokens=10,
        threads=1,
        quick=True,
        log=lambda s: None,
    )
    assert summary["questions"] == list(QUESTIONS) and len(set(summary["questions"])) == 4
    rows = summary["rows"]
    assert {(r["method"], r["workload"]) for r in rows} >= {
        ("auto", "four_questions"),
        ("serial", "one_question"),
    }
    assert all(r["identical"] for r in rows), [
        (r["method"], r["workload"]) for r in rows if not r["identical"]
    ]
    for r in rows:
        p = r["projected_e2e"]
        assert "projection" in p["label"] and p["speedup"][0] <= p["speedup"][1]
        if r["method"] == "auto":
            used = r["keep_ratio_used"]
            # (None: the answer went to the target alone)
            assert (
                len(used) == 4
                if r["workload"] == "four_questions"
                else used is None or isinstance(used, float)
            )
    assert "Questions of the four-question workload" in long.markdown(summary)
    text = report.read_text()
    assert text.startswith("# hippo bench results\n\nThe short-video report.\n\n## Long videos")
    first = text.split("\n")[6]  # after the heading and a blank line
    assert re.match(r"`hippo bench --long --quick` \(\d+ min \d+ s, peak resident memory \d", first), first
    assert (tmp_path / "results" / "bench-long" / "results.json").is_file()


def test_the_batch_projection_charges_each_round_at_the_batch_costs() -> None:
    """`throughput`'s projection: a forward of B rows reads the weights once and B KV caches; a batch's
    round drafts as many tokens as its longest row; parallel rounds hide q behind p."""
    from types import SimpleNamespace

    from hippo.benchmarks.projection import PAPER_N, batch_decode_projection, batch_forwards

    t1, d1 = batch_forwards(1, PAPER_N[0])
    t8, d8 = batch_forwards(8, PAPER_N[0])
    assert 1.0 < t8 / t1 < 1.5 and 1.0 < d8 / d1 < 1.5  # bandwidth-bound: weights dominate

    def row(drafted, new_tokens, target_steps=0):
        return SimpleNamespace(
            stats=SimpleNamespace(drafted_per_round=drafted, new_tokens=new_tokens, target_steps=target_steps)
        )

    alone = batch_decode_projection([row([], 13)] * 4, parallel=False)
    assert alone["speedup_over_target_alone"] == pytest.approx([1.0, 1.0]) and "projection" in alone["label"]
    good = [row([5, 5], 13), row([5, 3], 11)]  # rows in step: round 2 drafts 5 (the longest row's)
    serial = batch_decode_projection(good, parallel=False)
    parallel = batch_decode_projection(good, parallel=True)
    expected = [12 * t / (2 * (5 * d + t)) for t, d in (batch_forwards(2, n0) for n0 in PAPER_N)]
    assert serial["speedup_over_target_alone"] == pytest.approx(sorted(expected))
    assert 1.0 < serial["speedup_over_target_alone"][0] < parallel["speedup_over_target_alone"][0]
    poor = batch_decode_projection([row([1] * 12, 13)] * 2, parallel=False)
    assert poor["speedup_over_target_alone"][1] < 1.0  # a draft that never helps costs its forwards


def test_the_mat_over_answers_is_their_pooled_ratio_with_an_interval_that_shrinks_with_answers() -> None:
    """`ratio_ci`: MAT is all answers' tokens over all their rounds; its 95% interval holds it, is a
    point for one answer or for answers of one ratio, and narrows as the answers repeat."""
    from hippo.benchmarks.lists_eval import ratio_ci

    tokens, rounds = [9, 8, 7, 9], [3, 5, 2, 6]
    mat, lo, hi = ratio_ci(tokens, rounds)
    assert mat == pytest.approx(33 / 16) and lo < mat < hi
    assert ratio_ci([9], [3]) == (3.0, 3.0, 3.0)
    assert ratio_ci([6, 9], [2, 3]) == pytest.approx((3.0, 3.0, 3.0))
    _, lo4, hi4 = ratio_ci(tokens * 4, rounds * 4)
    assert hi4 - lo4 < (hi - lo) / 1.9


def test_the_report_states_the_mat_order_over_answers_and_whether_the_intervals_part() -> None:
    from hippo.benchmarks.long import claims_markdown

    sel = {s: {"mat": m, "ci95": [m - 0.1, m + 0.1]} for s, m in
           {"holistic": 2.1, "attention": 1.9, "uniform": 1.6, "full": 2.0, "oracle": 2.2}.items()}  # fmt: skip
    claims = {
        "position_bias": {
            "paper": "p",
            "visual_tokens": 8208,
            "base_rate": 0.3,
            "reproduced": False,
            "attention": {"share": 0.3, "ci95": [0.27, 0.33]},
            "holistic": {"share": 0.2, "ci95": [0.17, 0.23]},
        },  # fmt: skip
        "mat_order": {"paper": "p", "by_n": {}},
        "mat_order_clips": {
            **sel,
            "visual_tokens": 8192,
            "clips": 8,
            "answers": 32,
            "holistic_ge_attention_ge_uniform": True,
            "holistic_above_uniform_intervals_apart": True,
            "full_over_uniform": 1.25,
            "holistic_over_oracle": 0.95,
        },  # fmt: skip
        "pruning_pays": {"by_n": {}},
        "parallel": {"by_n": {}},
    }
    text = "\n".join(claims_markdown(claims))
    assert "MAT order over 32 answers" in text and "uniform 1.60 (1.50-1.70)" in text
    assert "The order holds; holistic and uniform intervals apart" in text
