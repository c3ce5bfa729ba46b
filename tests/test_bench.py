"""`hippo bench --quick` on the smallest setting writes a well-formed table and JSON."""

from __future__ import annotations

import json

from hippo.cli import main


def test_bench_quick_smallest_setting(tmp_path):
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
            "--out",
            str(out),
        ]
    )
    assert code == 0  # every method's output equals HF generate's
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
    table = (out / "table.md").read_text().splitlines()
    assert table[0].startswith("| method | lossless | MAT | MAT (paper) | speedup")
    assert len([line for line in table if line.startswith("| ")]) == len(names) + 1
    assert (out / "speedup.png").stat().st_size > 0
    assert (out / "position_bias.png").stat().st_size > 0
    assert 0 <= summary["position_bias"]["attention_boundary_share"] <= 1
