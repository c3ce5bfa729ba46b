"""`hippo bench --quick` on the smallest setting writes a well-formed table and JSON.

The bench's own `identical` column is not the oracle: every hippo output it times is recorded and
compared here with transformers' `generate` on the target.
"""

from __future__ import annotations

import json

import pytest
import torch

from hippo_benchmarks import bench
from hippo_cli.main import main


@pytest.fixture
def hippo_outputs(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(sequences a bench row's pipeline returned, target.generate's on the same inputs), per call."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = bench._hippo_call

    def recorded(pipe, inputs, gen):
        call = real(pipe, inputs, gen)
        with torch.inference_mode():
            ref = pipe.target.generate(**inputs, **{**gen, "do_sample": False})

        def run():
            seq, stats = call()
            seen.append((seq.cpu(), ref.cpu()))
            return seq, stats

        return run

    monkeypatch.setattr(bench, "_hippo_call", recorded)
    return seen


def assert_all_generate(seen: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    assert seen, "no hippo pipeline ran"
    bad = [i for i, (seq, ref) in enumerate(seen) if not torch.equal(seq, ref)]
    assert not bad, f"{len(bad)} of {len(seen)} hippo runs differ from target.generate"


def test_bench_quick_smallest_setting(tmp_path, hippo_outputs):
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "--quick",
            "--pair",
            "tiny",
            "--videos",
            "1",
            "--repeats",
            "1",
            "--max-new-tokens",
            "4",
            "--threads",
            "1",
            "--no-compile",
            "--out",
            str(out),
            "--timeline",
            str(tmp_path / "timeline.png"),
        ]
    )
    assert code == 0  # every method's output equals HF generate's
    assert_all_generate(hippo_outputs)
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"  # the HIPPO row's run, drawn
    summary = json.loads((out / "results.json").read_text())
    names = [r["name"] for r in summary["rows"]]
    for expected in (
        "HF generate (target alone)",
        "HF assisted (full video)",
        "SD (serial, full video)",
        "PEARL-video",
        "HIPPO",
        "SD-tree (full video)",
    ):
        assert expected in names
    for row in summary["rows"]:
        assert "error" not in row, row
        assert row["identical"] and row["mat"] >= 1.0 and row["seconds"] > 0
        assert row["mat_paper"] >= row["mat"] and 0 < row["prefill_share"] < 1
    assert {"torch", "transformers", "seed", "cpu_count"} <= set(summary["environment"])
    assert set(summary["per_video"]) == set(names)  # the raw figures behind every median
    assert all(len(v["times"]) == 1 and "stats" in v for v in summary["per_video"]["HIPPO"])
    assert summary["generation"] == {"max_new_tokens": 4, "min_new_tokens": 0}
    assert "HF generate, static cache + torch.compile" not in names  # --no-compile
    table = (out / "table.md").read_text()
    headline = table.split("### Speed and acceptance (paper Table 1)\n\n")[1].split("\n\n")[0].splitlines()
    assert headline[0].startswith(
        "| method | lossless | MAT | MAT (paper) | e2e speedup | decode-phase speedup"
    )
    assert len(headline) == len(names) + 2
    by = {r["name"]: r for r in summary["rows"]}
    # the paper-hardware projection: AR rows are 1x by construction, every main chain row has one
    assert abs(by["autoregressive"]["projected_speedup"] - 1.0) < 1e-9
    assert all(by[n]["projected_speedup"] > 0 for n in ("SD (serial, full video)", "PEARL-video", "HIPPO"))
    assert "projected_speedup" not in by["SD-tree (full video)"]
    assert "### Time breakdown (paper Table 2)" in table and "### Regime" in table
    regime = summary["regime"]
    assert 0 < regime["prefill_share"] < 1 and regime["decode_gb_per_s"] > 0
    assert 0 < regime["draft_cost_ratio_pruned"] and regime["verify_over_decode"] > 0
    assert (out / "speedup.png").stat().st_size > 0
    assert (out / "position_bias.png").stat().st_size > 0
    assert 0 <= summary["position_bias"]["attention_boundary_share"] <= 1


def test_bench_fixed_length_runs_suppress_eos_until_min_new_tokens(hippo_outputs):
    """`--min-new-tokens` makes every method run the same number of tokens, still lossless."""
    w = bench.tiny_workload(1, seed=3)
    inputs = w.inputs[0]
    first = w.target.generate(**inputs, max_new_tokens=1, do_sample=False)[0, -1]
    w.target.generation_config.eos_token_id = int(first)  # without the minimum, every run stops at once
    rows = [m for m in bench.methods(0.5, 3, quick=True) if m.name in ("HF generate (target alone)", "HIPPO")]
    summary = bench.run(
        w,
        rows,
        max_new_tokens=7,
        min_new_tokens=7,
        repeats=1,
        threads=1,
        gamma=3,
        project=False,
        log=lambda _: None,
    )
    for name, videos in summary["per_video"].items():
        assert [v["new_tokens"] for v in videos] == [7], name
        assert all(v["identical"] for v in videos), name
    assert_all_generate(hippo_outputs)
