"""`hippo check --sampling` on every backbone: each adapter's law cases are calibrated to be checkable.

A law check is checkable when the target's law gives its likeliest sequence at most 0.9 (a pipeline
that never samples is then seen) and reaches power 0.95 against a TV 0.05 error within its run
budget (3,000 runs). The stock temperatures are on Qwen2.5-VL's tiny target, not on the others'
(LLaVA-OneVision's default law is too peaked, Qwen3-VL's and video-SALMONN2+'s too flat), so each
stage of `hippo check --sampling` runs at the temperature `hippo.testing.calibration` computes for
the backbone (`law_case`), a third party's included: here a backbone registered through the plugin
hooks (`hippo_register_adapters`, `hippo_resolve_adapter`) with its own tiny model.

The proof on every backbone: a verifier that decodes greedily under a sampling flag
(`planted_greedy_collapse`) fails `hippo check --sampling --adapter X` (exit 1), and its honest twin,
the stock tree verifier it overrides, passes every stage of its plan (token trees, the default case,
a conversation's turn 2) at full power (exit 0); on the third party's backbone, the default case. Those
runs (about 6,500 each) carry the `matrix` mark; the calibration itself runs in the default tier.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

import hippo
from hippo.adapters import qwen2_5_vl_tiny
from hippo.adapters import tiny as tiny_parts
from hippo.adapters.qwen2_5_vl import Qwen25VLAdapter
from hippo.cli.main import main
from hippo.testing import calibration as hc
from hippo.testing import power as pw
from hippo.testing import sampling as hs
from hippo.testing.planted import planted_plugin
from hippo.testing.report import VacuousCheck

BUILT_IN = ("qwen2_5_vl", "qwen3_vl", "llava_onevision", "video_salmonn2_plus")
THIRD_PARTY = "tiny_thirdparty_vlm"


# ---- a third party's backbone, registered through the plugin hooks, with its own tiny model ---------


class ThirdPartyConfig(Qwen2_5_VLConfig):
    model_type = THIRD_PARTY


def tiny_model(role: str = "target", *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The third party's tiny model (`Adapter.tiny_module` is this module): its own config class and
    sizes (a wider MLP), its own weights."""
    fields = {k: v for k, v in qwen2_5_vl_tiny.tiny_config(role).to_dict().items() if k != "model_type"}
    fields["text_config"]["intermediate_size"] *= 2
    config = ThirdPartyConfig(**fields)
    return tiny_parts.seeded_model(Qwen2_5_VLForConditionalGeneration, config, seed + 17, dtype)


synthetic_inputs = qwen2_5_vl_tiny.synthetic_inputs


class ThirdPartyAdapter(Qwen25VLAdapter):
    name = THIRD_PARTY
    model_types = (THIRD_PARTY,)
    tiny_module = __name__


class _ThirdPartyPlugin:
    @hippo.hookimpl
    def hippo_register_adapters(self):
        return {THIRD_PARTY: ThirdPartyAdapter}

    @hippo.hookimpl
    def hippo_resolve_adapter(self, config):
        return ThirdPartyAdapter if getattr(config, "model_type", None) == THIRD_PARTY else None


@pytest.fixture
def third_party():
    pm = hippo.plugin_manager()
    plugin = _ThirdPartyPlugin()
    pm.register(plugin, name="tests-third-party-backbone")
    try:
        yield THIRD_PARTY
    finally:
        pm.unregister(plugin=plugin)


# ---- the calibration ---------------------------------------------------------------------------------


def test_calibration_on_a_known_tree():
    """Two steps of two tokens with logit gaps 0.01 then 0.05 (a tree without a model): at the stock
    T = 0.01 the law is too flat (the first step is 73/27: over 3,000 runs), so the calibration lowers T to the
    checkable law with the fewest runs; the likeliest sequence then holds at most 0.9 and the law
    reaches the power, which `LawCheck.plan` confirms; a run budget no law meets is refused."""
    v = 5
    scores = torch.full((v,), -10.0, dtype=torch.float64)

    def node(gap: float) -> torch.Tensor:
        s = scores.clone()
        s[1], s[2] = 1.0, 1.0 - gap
        return s

    tree = {(): node(0.01), (1,): node(0.05), (2,): node(0.05)}
    stock = hc.law_at(tree, 0.01, 2)
    assert max(stock.values()) < 0.75 and hc.checkable(stock, max_runs=3000, max_mode=0.9) is None
    cal = hc.calibrate(tree, 0.01, 2)
    assert not cal.stock and cal.temperature < 0.01 and cal.mode <= hs.MAX_MODE and cal.power >= pw.POWER
    law = hc.law_at(tree, cal.temperature, 2)
    check = hs.LawCheck.plan(law)
    assert check.runs == cal.runs and check.result.power >= pw.POWER
    assert hc.calibrate(tree, 0.05, 2).temperature < 0.01  # found from above, too
    with pytest.raises(VacuousCheck, match="no temperature from .* makes the case checkable"):
        hc.calibrate(tree, 0.01, 2, max_runs=100)


def test_a_checkable_stock_temperature_is_kept():
    """On Qwen2.5-VL every stage's stock law is checkable: its temperature is kept (the suite's
    planted-bug matrix checks those laws)."""
    for stage, stock in [("default", 0.01), ("token trees", 0.0098), ("conversation turn 2", 0.0094)]:
        case = hc.law_case("qwen2_5_vl", stage)
        assert case["temperature"] == stock and case["calibration"].stock, (stage, case)


@pytest.mark.parametrize(("adapter", "why"), [("llava_onevision", "too peaked"), ("qwen3_vl", "too flat")])
def test_the_default_case_is_calibrated_where_the_stock_law_is_not_checkable(adapter, why):
    """`assert_sampling_exact` at the stock T = 0.01 is refused on these backbones; its default
    (temperature=None) runs at the calibrated T, whose law is checkable."""
    case = hs.sampling_case(adapter)
    with pytest.raises(VacuousCheck, match=why):
        hs.LawCheck.plan(hs.target_law(case, 0.01, 2))
    cal = hs.case_calibration(case)
    assert not cal.stock and cal.temperature != 0.01
    law = hs.target_law(case, cal.temperature, 2)
    check = hs.LawCheck.plan(law)
    assert max(law.values()) <= hs.MAX_MODE and check.result.power >= pw.POWER and check.runs <= 3000
    print(adapter, cal.summary())


# ---- hippo check --sampling on every backbone: a greedy collapse fails, its honest twin passes ---------


def _check(name: str, adapter: str, capsys, *laws: str) -> tuple[int, str]:
    args = ["check", name, "--kind", "verifier", "--sampling", "--examples", "1", "--adapter", adapter]
    with planted_plugin():
        rc = main([*args, "--no-shrink", *(a for law in laws for a in ("--law", law))])
    out = capsys.readouterr().out
    print(out)
    return rc, out


def _stages(out: str) -> list[tuple[str, float, float]]:
    """(stage, mode, power) of each law stage `hippo check` passed."""
    found = re.findall(
        r"^sampling, (.*): exact law, \d+ runs, .*\(mode ([\d.]+)\).* power ([\d.]+) at", out, re.M
    )
    return [(stage, float(mode), float(power)) for stage, mode, power in found]


@pytest.mark.matrix
@pytest.mark.parametrize("adapter", BUILT_IN)
def test_hippo_check_sampling_on_every_backbone(adapter, capsys):
    """Exit 1 on the collapsed verifier, caught at the first look of its first stage; exit 0 on its
    honest twin, the stock tree verifier, whose three stages (the conversation's turn 2 included) each
    ran at full power on a law with at most 0.9 on one sequence (each stage's law is enumerated
    exactly at its calibrated temperature and planned by `LawCheck.plan`)."""
    rc, out = _check("planted_greedy_collapse", adapter, capsys)
    assert rc == 1 and "greedy: lossless" in out and "sampling check FAILED" in out, out
    # caught at the first stage of its plan, at its first look (about N/10 runs)
    assert "the law check on token trees with siblings tested FAILED" in out, out
    assert re.search(r"law is off after \d+ runs", out), out
    rc, out = _check("tree", adapter, capsys)
    assert rc == 0, out
    stages = _stages(out)
    assert len(stages) == 3, out  # token trees, the default case, a conversation's turn 2
    assert all(mode <= hs.MAX_MODE and power >= pw.POWER for _, mode, power in stages), out


@pytest.mark.matrix
def test_hippo_check_sampling_on_a_third_party_backbone(third_party, capsys):
    """The same on the third party's backbone (registered through the plugin hooks): every stage's
    law case is checkable; the collapse fails, its honest twin passes the default case (the other
    stages' pipelines are the built-in backbones', above)."""
    for stage in hc.STAGES:
        cal = hc.law_case(third_party, stage)["calibration"]
        assert cal.mode <= hs.MAX_MODE and cal.power >= pw.POWER and cal.runs <= 3000, (stage, cal)
    rc, out = _check("planted_greedy_collapse", third_party, capsys)
    assert rc == 1 and "the law check on token trees with siblings tested FAILED" in out, out
    rc, out = _check("tree", third_party, capsys, "default")
    assert rc == 0 and len(_stages(out)) == 1, out
