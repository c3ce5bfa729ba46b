"""The multi-device layout: a target placed by a device map, the draft on a device of its own.

Every check runs on the CPU: a map naming "cpu" for every module reaches `from_pretrained` and the
output is exactly the target's own greedy output (float64, tiny Qwen2.5-VL pair saved to disk), also
through accelerate's dispatch hooks and with the draft in its own process. The CUDA layout (the
target over the GPUs, the draft on the last one) is `hippo.benchmarks.gpu_check --devices`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hippo import PipelineBuilder, PipelineConfig
from hippo.devices import DEVICE_MAPS, input_device, model_devices, output_device, resolve_device_map
from hippo.errors import ConfigError
from hippo.registry import lookup

ADAPTER = lookup("adapters", "qwen2_5_vl")
NEW = 12
#: every module of the tiny Qwen2.5-VL named, all on the CPU
CPU_MAP = {"model.visual": "cpu", "model.language_model": "cpu", "lm_head": "cpu"}
SCHEDULE = {"scheduler": {"name": "serial", "gamma": 3}, "selector": {"name": "uniform", "keep_ratio": 0.5}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("devices")
    for role, seed in (("target", 0), ("draft", 1)):
        ADAPTER.tiny_model(role, seed=seed, dtype=torch.float64).save_pretrained(root / role)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def inputs(checkpoints):
    target = ADAPTER.model_class.from_pretrained(checkpoints[0])
    g = torch.Generator().manual_seed(3)
    return ADAPTER.synthetic_inputs(target, torch.rand(4, 56, 56, 3, generator=g), [1, 17, 42], [61, 19])


@pytest.fixture(scope="module")
def reference(checkpoints, inputs) -> torch.Tensor:
    target = ADAPTER.model_class.from_pretrained(checkpoints[0])
    with torch.inference_mode():
        return target.generate(**inputs, max_new_tokens=NEW, do_sample=False)


@pytest.fixture
def loads(monkeypatch) -> list[dict]:
    """The keywords of every `from_pretrained` the adapter makes."""
    seen: list[dict] = []
    original = ADAPTER.load.__func__

    def load(cls, path, **kwargs):
        seen.append({"path": str(path), **kwargs})
        return original(cls, path, **kwargs)

    monkeypatch.setattr(ADAPTER, "load", classmethod(load))
    return seen


def config(checkpoints, **devices) -> dict:
    return {"target": str(checkpoints[0]), "draft": str(checkpoints[1]), **SCHEDULE, **devices}


# ---- the map reaches from_pretrained; the output is the target's --------------------------------


@pytest.mark.parametrize("as_file", [True, False], ids=["json-file", "dict"])
def test_a_device_map_reaches_from_pretrained_and_the_output_is_exact(
    checkpoints, inputs, reference, loads, tmp_path, as_file
) -> None:
    path = tmp_path / "map.json"
    path.write_text(json.dumps(CPU_MAP))
    cfg = config(checkpoints, target_device_map=str(path) if as_file else CPU_MAP, draft_device="cpu")
    pipe = PipelineBuilder.from_config(cfg).build()
    by_path = {d["path"]: d for d in loads}
    assert by_path[str(checkpoints[0])]["device_map"] == CPU_MAP
    assert "device_map" not in by_path[str(checkpoints[1])]  # the draft is placed with --draft-device
    assert pipe.target_adapter.devices == (torch.device("cpu"),)
    out = pipe.generate(inputs, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out.sequences, reference)


@pytest.mark.parametrize("name", DEVICE_MAPS)
def test_a_named_map_reaches_from_pretrained(checkpoints, inputs, reference, loads, name) -> None:
    """accelerate computes the map (all CPU here: there is no GPU); the output is the target's."""
    pipe = PipelineBuilder.from_config(config(checkpoints, target_device_map=name)).build()
    assert [d.get("device_map") for d in loads] == [name, None]
    assert torch.equal(pipe.generate(inputs, max_new_tokens=NEW, do_sample=False).sequences, reference)


@pytest.mark.parametrize(
    "schedule",
    [
        {"name": "serial", "gamma": 3},
        {"name": "hippo", "gamma": 3, "executor": "inline", "executor_options": {"overlap": "thread"}},
        {"name": "autoregressive"},
    ],
    ids=["serial", "hippo-thread", "autoregressive"],
)
def test_a_target_behind_accelerate_hooks_is_exact(checkpoints, inputs, reference, schedule) -> None:
    """A target dispatched by accelerate (its hooks move each module's inputs to the module's device
    and the outputs back): every schedule, alone and batched, gives the target's greedy output."""
    accelerate = pytest.importorskip("accelerate")
    target = ADAPTER.model_class.from_pretrained(checkpoints[0], device_map=CPU_MAP)
    accelerate.dispatch_model(target, CPU_MAP, force_hooks=True)
    assert hasattr(target.lm_head, "_hf_hook")
    cfg = {**config(checkpoints, draft_device="cpu"), "scheduler": schedule}
    cfg.pop("target")
    pipe = PipelineBuilder.from_config(cfg).target(target).build()
    assert torch.equal(pipe.generate(inputs, max_new_tokens=NEW, do_sample=False).sequences, reference)
    if pipe.can_batch():
        outs = pipe.generate([inputs, inputs], max_new_tokens=NEW, do_sample=False)
        assert all(torch.equal(o.sequences, reference) for o in outs)
    pipe.close()


@pytest.mark.xdist_group("processes")
def test_the_draft_process_runs_on_the_draft_device(checkpoints, inputs, reference, tmp_path) -> None:
    """The process executor with a mapped target: the draft in its own process, on --draft-device,
    drafts every round (no fallback to the target alone) and the output is exact."""
    path = tmp_path / "map.json"
    path.write_text(json.dumps(CPU_MAP))
    cfg = config(checkpoints, target_device_map=str(path), draft_device="cpu")
    cfg["scheduler"] = {"name": "hippo", "gamma": 3, "executor": "process"}
    pipe = PipelineBuilder.from_config(cfg).build()
    try:
        out = pipe.generate(inputs, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out.sequences, reference)
        assert not out.stats.fallback, out.stats.notes
        assert sum(out.stats.drafted_per_round) > 0 and out.stats.seconds_draft_decode > 0
        assert pipe.scheduler.executor.pid is not None
    finally:
        pipe.close()


def test_where_a_model_lives() -> None:
    model = ADAPTER.tiny_model("draft", seed=0)
    assert input_device(model) == output_device(model) == torch.device("cpu")
    assert model_devices(model) == (torch.device("cpu"),)


# ---- bad values: ConfigError naming what is wrong and what to do ---------------------------------


def test_bad_maps_are_refused_before_anything_loads(tmp_path) -> None:
    cases = {
        "balance": "is neither a device map name (auto, balanced, balanced_low_0, sequential) nor a JSON file",
        str(tmp_path / "missing.json"): "cannot be read",
        str(tmp_path): "cannot be read",
    }
    bad = tmp_path / "bad.json"
    bad.write_text("{model: cpu")
    cases[str(bad)] = "is not valid JSON"
    listed = tmp_path / "list.json"
    listed.write_text('["cpu"]')
    cases[str(listed)] = "must hold a JSON object"
    for value, message in cases.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            PipelineBuilder.from_config({"target_device_map": value})
    entries = {
        "foo": "is not a device name; use cpu, cuda or cuda:N",
        "disk": "is not a device hippo decodes on",
        "meta": "is not a device hippo decodes on",
        -1: "a GPU index is >= 0",
        1.5: "a device is a name like 'cuda:1'",
    }
    if not torch.cuda.is_available():
        entries.update({"cuda:0": "CUDA is not available", 0: "CUDA is not available"})
    for device, message in entries.items():
        with pytest.raises(ConfigError, match=f"device map entry 'lm_head'.*{message}"):
            resolve_device_map({"model": "cpu", "lm_head": device})
    with pytest.raises(ConfigError, match="is an empty map"):
        resolve_device_map({})


def test_device_and_a_target_map_conflict() -> None:
    with pytest.raises(ConfigError, match=r"both place the target \(--device, --target-device-map\)"):
        PipelineBuilder.from_config({"device": "cpu", "target_device_map": "auto"})


def test_bad_draft_device() -> None:
    with pytest.raises(ConfigError, match="draft device 'gpu3' is not a device name"):
        PipelineBuilder.from_config({"draft_device": "gpu3"})
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available; use --draft-device cpu"):
            PipelineBuilder.from_config({"draft_device": "cuda:3"})
    with pytest.raises(ConfigError, match="draft_device must be a device name"):
        PipelineConfig.from_dict({"draft_device": 3})
    with pytest.raises(ConfigError, match="target_device_map must be a map name"):
        PipelineConfig.from_dict({"target_device_map": 3})


def test_a_map_needs_accelerate(monkeypatch) -> None:
    import hippo.devices

    real = hippo.devices.importlib.util.find_spec
    monkeypatch.setattr(
        hippo.devices.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "accelerate" else real(name, *a),
    )
    for value in ("balanced", CPU_MAP):
        with pytest.raises(ConfigError, match=r"needs the accelerate package.*pip install accelerate"):
            PipelineBuilder.from_config({"target_device_map": value})


def test_a_map_places_a_checkpoint_not_a_loaded_model() -> None:
    model = ADAPTER.tiny_model("target", seed=0)
    b = PipelineBuilder().devices(target_device_map="auto").target(model).scheduler("autoregressive")
    with pytest.raises(ConfigError, match="places a target loaded from a checkpoint path"):
        b.build()


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--video", "v.mp4", "--prompt", "x"],
        ["chat", "--video", "v.mp4"],
        ["batch", "in.jsonl", "out.jsonl"],
        ["serve", "--media-dir", "."],
    ],
    ids=lambda c: c[0],
)
def test_every_command_takes_the_layout(command) -> None:
    """generate, chat, batch and serve share the flags and the way to the builder's config."""
    from hippo.cli.main import build_parser
    from hippo.cli.video_commands import pipeline_config

    flags = ["--target", "t", "--target-device-map", "balanced", "--draft-device", "cpu"]
    cfg = pipeline_config(build_parser().parse_args([*command, *flags]))
    assert (cfg.target_device_map, cfg.draft_device, cfg.device) == ("balanced", "cpu", None)


def test_a_named_map_leaves_the_draft_gpu_out(monkeypatch) -> None:
    """`balanced` and a draft on cuda:3 of four GPUs: the target's max_memory has no cuda:3."""
    pytest.importorskip("accelerate")
    import accelerate.utils

    from hippo.devices import draft_gpu_left_out

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    free = {0: 100, 1: 100, 2: 100, 3: 100, "cpu": 50}
    monkeypatch.setattr(accelerate.utils, "get_max_memory", lambda: dict(free))
    assert draft_gpu_left_out("balanced", "cuda:3") == {0: 100, 1: 100, 2: 100, "cpu": 50}
    assert draft_gpu_left_out("balanced", "cpu") is None
    assert draft_gpu_left_out({"": "cuda:0"}, "cuda:3") is None  # a dict map places every module
    assert draft_gpu_left_out("balanced", None) is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert draft_gpu_left_out("balanced", "cuda:0") is None  # one GPU: shared
