"""Packed linear weights (`hippo.packed`, on by default for the target) change no token.

oneDNN's packed linear has no float64 kernel, so the float64 harness runs with packing inert;
these tests run in float32, where the packed path is live (the harness's `dtypes=("float32",)`). A float32 verification and a one-token
step already round differently (batched vs single-token GEMMs), so equality with `generate` holds
unless two logits tie within float32 rounding; the fixed cases below have no such tie, and every
test checks that the packed weights were really used.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import strategies as st

import hippo
from hippo.errors import ConfigError
from hippo.packed import PackedLinear, PackedLinears, available
from hippo.session import PackedSessions
from hippo.testing import assert_greedy_lossless
from hippo.testing import models as hm
from hippo.testing import params as hp
from hippo.testing import reference as hr
from hippo.testing import strategies as hs

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN packed linear")

ADAPTERS = [p.values[0] for p in hp.adapter_params() if not p.marks]
# drafting schedulers first: the harness's fixed examples take each draw's first value
SCHEDULERS = sorted(hm.names("schedulers"), key=lambda n: n not in hm.drafting_schedulers())
_F32: dict[tuple[str, str], torch.nn.Module] = {}


def tiny32(adapter: str, role: str = "target") -> torch.nn.Module:
    if (adapter, role) not in _F32:
        cls = hm.part_class("adapters", adapter)
        _F32[adapter, role] = cls.tiny_model(role, seed=0, dtype=torch.float32).eval()
    return _F32[adapter, role]


def prompt(adapter: str, target) -> dict:
    inputs = hm.Prompt.default(adapter, target).inputs
    return {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}


def test_routes_only_few_token_forwards_of_its_own_weights():
    model = tiny32("qwen2_5_vl")
    packed = PackedLinears.of(model)
    assert packed is PackedLinears.of(model) and packed.packs and packed.bytes > 0
    layer = model.get_output_embeddings()
    head = layer.weight
    assert id(head) in packed.packs and type(layer) is PackedLinear  # the output head is packed ...
    vision = next(m for m in model.model.visual.modules() if isinstance(m, torch.nn.Linear))
    assert (
        id(vision.weight) not in packed.packs and type(vision) is torch.nn.Linear
    )  # ... not the vision tower
    x = torch.randn(1, 6, head.shape[1])  # [B, k, D]
    with torch.inference_mode():
        eager = torch.nn.functional.linear(x, head)
        assert packed.routed == 0
        with packed.rows(65):  # a prefill stays on the ordinary kernel (`prefill` routes it)
            layer(x)
        assert packed.routed == 0
        with packed.rows(1):  # a one-token step
            torch.testing.assert_close(layer(x[:, :1]), eager[:, :1], rtol=1e-5, atol=1e-5)
        assert packed.routed == 1
        with packed.rows(6):
            out = layer(x)  # [1, 6, V]
            other = torch.nn.functional.linear(x, head)  # not through the layer
            t = threading.Thread(target=lambda: layer(x))
            t.start()
            t.join()
        assert packed.routed == 2  # the routing holds in the calling thread only
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(other, eager, rtol=0, atol=0)
        torch.testing.assert_close(layer(x), eager, rtol=0, atol=0)  # outside the context: nn.Linear
    with packed.prefill():  # a prompt's prefill, of any length, but only what runs in inference mode
        layer(x)
        with torch.inference_mode():
            layer(torch.randn(1, 300, head.shape[1]))
    assert packed.routed == 3
    with torch.no_grad():
        head.add_(0.0)  # changed in place since packing: the stale packing is not used
    with torch.inference_mode(), packed.rows(6):
        layer(x)
    assert packed.routed == 3


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_packed_pipelines_equal_target_generate(adapter):
    target, draft = tiny32(adapter), tiny32(adapter, "draft")
    inputs = prompt(adapter, target)
    ref = target.generate(**inputs, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    packed = PackedLinears.of(target)
    for scheduler, roles in (
        ("serial", ("target",)),
        ("hippo", ("target", "draft")),
        ("serial_tree", ("target",)),
    ):
        before = packed.routed
        b = hippo.PipelineBuilder().target(target).draft(draft).scheduler(scheduler, gamma=4)
        pipe = b.selector("uniform", keep_ratio=0.5).pack(*roles).build()
        out = pipe.generate(inputs, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert out.sequences.tolist() == ref.tolist(), (adapter, scheduler)
        assert packed.routed > before, f"{scheduler}: the target's verifications did not use packed weights"
    before = packed.routed  # one new token: the target's prefill alone, on the packed weights
    b = hippo.PipelineBuilder().target(target).draft(draft).scheduler("serial", gamma=4)
    out = b.build().generate(inputs, max_new_tokens=1)
    assert out.sequences.tolist() == ref[:, : out.sequences.shape[1]].tolist() and packed.routed > before
    pipe = hippo.PipelineBuilder().target(target).draft(draft).pack().build()  # off
    assert pipe.sessions["target"] is None


def test_a_batch_prefills_its_rows_on_the_packed_weights():
    """`generate_batch` prefills each row as `generate` does: on the packed weights where the target
    is packed (one new token: the prefills alone run), on MKL where packing is off."""
    target, draft = tiny32("qwen2_5_vl"), tiny32("qwen2_5_vl", "draft")
    inputs = prompt("qwen2_5_vl", target)
    ref = target.generate(**inputs, max_new_tokens=1, do_sample=False).tolist()
    packed = PackedLinears.of(target)
    for roles, routes in ((("target",), True), ((), False)):
        pipe = hippo.PipelineBuilder().target(target).draft(draft).pack(*roles).build()
        before = packed.routed
        outs = pipe.generate_batch([inputs, inputs], max_new_tokens=1, do_sample=False)
        assert [o.sequences.tolist() for o in outs] == [ref, ref]
        assert (packed.routed > before) is routes, roles


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_packed_pipelines_in_the_harness(adapter):
    """The hypothesis harness on float32 pairs, where the target's packed weights (the default path)
    are live: every scheduler, selector/scorer pair and executor drawn, the draft packed too for
    some cases, corrupted drafts. Tokens equal target.generate's until a float32 tie of p's two top
    logits (hippo.testing.greedy.FLOAT32_TIE), and the verifications really used packed weights."""
    routed = []

    def build(case):
        x = case.extra
        selector, scorer = x["selector, scorer"]
        b = case.builder(x["scheduler"], selector=selector, scorer=scorer)
        return b.pack(*x["packed roles"])

    def used(case, out):
        routed.append(PackedLinears.of(case.target).routed)

    result = assert_greedy_lossless(
        build,
        adapters=[adapter],
        examples=hs.examples(0.5),
        dtypes=("float32",),
        draws={
            "scheduler": st.sampled_from(SCHEDULERS),
            "selector, scorer": st.sampled_from(hr.supported_pairs(adapter)),
            "packed roles": st.sampled_from([("target",), ("target", "draft")]),
        },
        on_output=used,
    )
    assert routed and routed[-1] > 0, "no verification used the packed weights"
    assert result.ties <= result.examples // 4 + 1, f"float32 ties in most examples: {result.summary()}"


def test_pack_options_are_checked():
    with pytest.raises(ConfigError, match="roles"):
        hippo.PipelineBuilder().pack("teacher")
    with pytest.raises(ConfigError, match="max_rows"):
        hippo.PipelineBuilder().pack("target", max_rows=1)
    with pytest.raises(ConfigError, match="does not take"):
        hippo.PipelineBuilder.from_config({"pack": {"roles": ["target"], "max_row": 16}})
    with pytest.raises(ConfigError, match="table"):
        hippo.PipelineBuilder.from_config({"pack": "target"})
    built = hippo.PipelineBuilder.from_config({"pack": {"roles": ["draft"], "max_rows": 16}})
    assert built._packed == {"target": None, "draft": PackedSessions(max_rows=16)}
    assert hippo.PipelineBuilder()._packed["target"] == PackedSessions()  # the default
