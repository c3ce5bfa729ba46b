"""`python -m hippo.benchmarks.gpu_check`: its CPU smoke mode, its verdict on a differing output, and
the real check on a GPU (skipped without CUDA)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch

from hippo.benchmarks import gpu_check


def test_cpu_smoke_mode_checks_every_eager_path_and_times_them(tmp_path, monkeypatch):
    # the GPU machine has neither video reader: the check must not import them
    monkeypatch.setitem(sys.modules, "decord", None)
    monkeypatch.setitem(sys.modules, "av", None)
    argv = ["--device", "cpu", "--quick", "--cases", "serial,hippo,batch,compiled", "--compile-mode", "eager"]
    assert gpu_check.main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["verdict"] == "PASS"
    cases = {(r["case"], r["dtype"]): r["status"] for r in report["equality"]}
    assert cases == {
        (c, d): "equal" for c in ("serial", "hippo", "batch", "compiled") for d in ("float32", "bfloat16")
    }
    rows = {r["name"]: r for r in report["timing"]}
    assert {"HF generate (target alone)", "hippo autoregressive", "serial, γ auto"} <= set(rows)
    assert all(r["tokens_per_second"] > 0 and r["output"]["status"] == "equal" for r in rows.values())
    assert rows["serial, γ auto"]["mat"] > 1  # the layer-skip draft is accepted
    text = (tmp_path / "gpu_check.txt").read_text().splitlines()
    assert text[-1].startswith("GPU CHECK PASS (cpu)")


def _reference(tokens: list[int], logits: list[list[float]]) -> SimpleNamespace:
    """A stand-in for generate's output: prompt [0], then `tokens`, with their step logits."""
    return SimpleNamespace(
        sequences=torch.tensor([[0, *tokens]]), logits=[torch.tensor([row]) for row in logits]
    )


def test_a_differing_output_is_a_tie_only_within_the_dtypes_rounding():
    ref = _reference([1, 2], [[0.0, 9.0, 1.0], [0.0, 1.0, 8.0]])
    assert gpu_check.compare(torch.tensor([[0, 1, 2]]), ref, 1, torch.bfloat16)["status"] == "equal"
    clear = gpu_check.compare(torch.tensor([[0, 1, 1]]), ref, 1, torch.bfloat16)
    assert clear["status"] == "differ" and clear["position"] == 1 and clear["top2_gap"] == 7.0
    near = _reference([1, 2], [[0.0, 9.0, 1.0], [0.0, 7.99, 8.0]])  # 0.01 apart at logits ~8
    assert gpu_check.compare(torch.tensor([[0, 1, 1]]), near, 1, torch.bfloat16)["status"] == "tie"
    assert gpu_check.compare(torch.tensor([[0, 1, 1]]), near, 1, torch.float32)["status"] == "differ"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_asking_for_cuda_without_a_gpu_exits_2(capsys):
    assert gpu_check.main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_check_passes_on_a_gpu(tmp_path):
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["verdict"] == "PASS" and report["equality"]


@pytest.mark.xdist_group("processes")  # a draft process
def test_the_devices_case_runs_its_path_on_the_cpu(tmp_path):
    """The multi-device case's code path end to end, with every module mapped to "cpu": the target
    reloaded by a JSON device map, the draft on --draft-device (here the CPU), exact."""
    pytest.importorskip("accelerate")
    argv = ["--device", "cpu", "--quick", "--cases", "devices", "--dtypes", "float32", "--no-timing"]
    assert gpu_check.main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    cases = {r["case"]: r for r in report["equality"]}
    assert set(cases) == {f"devices/{c}" for c in gpu_check.DEVICE_CASES}
    for r in cases.values():
        assert r["status"] == "equal" and r["target_devices"] == ["cpu"] and r["draft_device"] == "cpu"


def test_the_devices_layout_on_four_gpus(monkeypatch):
    """The paper's layout: the target's layers over cuda:0-2, its head on cuda:2, the draft on cuda:3."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    layout, draft = gpu_check.device_layout("cuda", 6)
    layers = [layout[f"model.language_model.layers.{i}"] for i in range(6)]
    assert layers == ["cuda:0", "cuda:0", "cuda:1", "cuda:1", "cuda:2", "cuda:2"]
    assert layout["model.language_model.embed_tokens"] == layout["model.visual"] == "cuda:0"
    assert layout["lm_head"] == "cuda:2" and draft == "cuda:3"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    layout, draft = gpu_check.device_layout("cuda", 6)
    assert set(layout.values()) == {"cuda:0"} and draft == "cuda:0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_the_devices_layout_without_a_gpu_says_so():
    with pytest.raises(RuntimeError, match="the devices case needs a CUDA device"):
        gpu_check.device_layout("cuda", 6)


@pytest.mark.gpu
def test_the_paper_layout_on_the_gpus(tmp_path):
    """The target spread by a device map over the GPUs (all but the last), the draft on the last one:
    exact against the mapped target's own greedy generate, in float32 and bfloat16."""
    if not torch.cuda.is_available():
        pytest.fail("this check needs at least one CUDA GPU; torch sees none")
    assert gpu_check.main(["--cases", "devices", "--no-timing", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    last = f"cuda:{torch.cuda.device_count() - 1}"
    assert report["equality"] and all(r["draft_device"] == last for r in report["equality"])
