"""`hippo bench --quick` on the smallest setting writes a well-formed table and JSON.

The bench's own `identical` column is not the oracle: every hippo output it times is recorded and
compared here with transformers' `generate` on the target.
"""

from __future__ import annotations

import json

import pytest
import torch

from hippo.benchmarks import bench
from hippo.cli.main import main


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


def _fake_results(seconds: float, scheduler: str, mat: float | None = None) -> dict:
    """One method's raw results on one video, shaped as `bench.run` records them."""
    stats = {"seconds_ttft": 0.5}
    if mat is not None:  # a hippo run
        stats |= {
            "mat": mat,
            "mat_accumulated": mat + 1,
            "seconds_target_prefill": 0.4,
            "seconds_target_decode": seconds - 0.6,
            "seconds_draft_prefill": 0.05,
            "seconds_draft_decode": 0.2,
            "seconds_pruning": 0.01,
            "seconds_total": seconds,
            "draft_hidden_fraction": 0.9,
        }
    video = {"seconds": seconds, "identical": True, "new_tokens": 64, "stats": stats, "times": [seconds]}
    return {"method": {"group": "main", "scheduler": scheduler}, "videos": [video]}


def test_bench_out_md_writes_one_markdown_report_with_the_machine(tmp_path, monkeypatch):
    """`hippo bench --out FILE.md` writes the report (machine, CPU flags, versions, date, tables) to
    FILE.md and the raw files to results/bench; the run itself is replaced by a fixed fake result."""
    from hippo.benchmarks import bench, report

    results = {
        "HF generate (target alone)": _fake_results(4.0, "autoregressive"),
        "autoregressive": _fake_results(3.6, "autoregressive", mat=1.0),
        "HIPPO": _fake_results(1.6, "hippo", mat=4.0),
    }
    costs = {
        "t_decode": 0.02,
        "t_verify": 0.03,
        "t_verify_unpacked": 0.05,
        "t_draft_full": 0.002,
        "t_draft_pruned": 0.0015,
        "weight_bytes": 126e6,
        "packed_bytes": 126e6,
        "threads": 2,
    }
    monkeypatch.setattr(bench, "run", lambda *a, **k: bench.summarise(results, costs, k["gamma"]))
    monkeypatch.setattr(bench, "position_bias_chart", lambda w, keep, out: {})
    monkeypatch.setattr(
        report,
        "cpu_info",
        lambda: {"cpu_model": "Test CPU 9000", "cpu_flags": ["avx2", "fma"], "cpu_capability": "AVX2"},
    )
    monkeypatch.chdir(tmp_path)
    report = tmp_path / "docs" / "RESULTS.md"
    args = ["bench", "--quick", "--pair", "tiny", "--videos", "1", "--no-compile", "--out", str(report)]
    assert main(args) == 2  # its directory does not exist: refused before any work
    report.parent.mkdir()
    assert main(args) == 0
    text = report.read_text()
    assert text.startswith("# hippo bench results\n")
    assert "| CPU | Test CPU 9000," in text and "| CPU flags | avx2 fma; torch's CPU kernels: AVX2 |" in text
    assert "`hippo bench --quick --pair tiny`: 1 videos x 1 repeats, up to 48 new tokens" in text
    assert "torch " in text and "transformers " in text and " UTC" in text  # versions and date
    headline = text.split("### Speed and acceptance (paper Table 1)\n\n")[1].split("\n\n")[0].splitlines()
    assert headline[2:] == [
        "| HF generate (target alone) | yes | 1.00 | 1.00 | 1.00x | 1.00x |  |",
        "| autoregressive | yes | 1.00 | 2.00 | 1.11x | 1.09x |  |",
        "| HIPPO | yes | 4.00 | 5.00 | 2.50x | 2.92x |  |",
    ]
    assert "### Time breakdown (paper Table 2)" in text
    raw = tmp_path / "results" / "bench"
    assert (raw / "table.md").read_text() == text  # the directory's copy of the same report
    assert json.loads((raw / "results.json").read_text())["environment"]["cpu_model"] == "Test CPU 9000"
    assert (raw / "speedup.png").stat().st_size > 0


def test_cpu_info_reads_the_model_and_the_vector_flags(tmp_path):
    from hippo.benchmarks.report import cpu_info

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f amx_tile ht\n"
        "\nprocessor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f amx_tile ht\n"
    )
    info = cpu_info(cpuinfo)
    assert info["cpu_model"] == "AMD EPYC 9R14"
    assert info["cpu_flags"] == ["amx_tile", "avx", "avx2", "avx512f", "fma", "sse4_2"]
    assert info["cpu_capability"]  # torch's kernel level, e.g. "AVX2"
