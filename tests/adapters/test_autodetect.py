"""Auto-detection: a checkpoint's config selects its adapter through the firstresult hook, and a
third party adds a backbone by shipping an adapter plugin (here: a fake backbone registered at
runtime, exactly as an entry-point plugin's module would be)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

import hippo
from hippo.adapters.qwen2_5_vl import Qwen25VLAdapter
from hippo.adapters.qwen2_5_vl_tiny import synthetic_inputs, tiny_config
from hippo.errors import PluginError
from hippo.registry import build_plugin_manager, resolve_adapter


class FakeVLMConfig(Qwen2_5_VLConfig):
    model_type = "fake_vlm"


class FakeVLMAdapter(Qwen25VLAdapter):
    """A "new backbone" that happens to share Qwen2.5-VL's layout."""

    name = "fake_vlm"
    model_types = ("fake_vlm",)


class FakeBackbonePlugin:
    @hippo.hookimpl
    def hippo_register_adapters(self):
        return {FakeVLMAdapter.name: FakeVLMAdapter}

    @hippo.hookimpl
    def hippo_resolve_adapter(self, config):
        return FakeVLMAdapter if getattr(config, "model_type", None) == "fake_vlm" else None


def fake_model():
    fields = {k: v for k, v in tiny_config("target").to_dict().items() if k != "model_type"}
    cfg = FakeVLMConfig(**fields)
    assert cfg.model_type == "fake_vlm"
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).double().eval()
    model.generation_config.eos_token_id = 2
    return model


def test_builtin_configs_resolve_to_their_adapters():
    for model_type, name in [
        ("qwen2_5_vl", "qwen2_5_vl"),
        ("qwen3_vl", "qwen3_vl"),
        ("llava_onevision", "llava_onevision"),
    ]:
        assert resolve_adapter(AutoConfig.for_model(model_type)).name == name


def test_unknown_backbone_is_a_clear_error():
    model = fake_model()
    with pytest.raises(PluginError, match="no hippo adapter handles model_type 'fake_vlm'"):
        hippo.PipelineBuilder(build_plugin_manager()).target(model).draft(model).build()


def test_third_party_backbone_plugin_is_detected_and_lossless():
    pm = build_plugin_manager(plugins=[FakeBackbonePlugin()])
    model = fake_model()
    inputs = synthetic_inputs(model, torch.rand(2, 56, 56, 3), [1, 10, 11], [13])
    ref = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    pipe = hippo.PipelineBuilder(pm).target(model).draft(model).scheduler("serial", gamma=3).build()
    assert isinstance(pipe.target_adapter, FakeVLMAdapter)
    assert torch.equal(pipe.generate(inputs, max_new_tokens=8, do_sample=False).sequences, ref)
