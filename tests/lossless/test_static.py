"""Static-cache sessions are lossless: `PipelineBuilder.compile(...)` changes no token.

- Static cache, eager (`mode="eager"`): every adapter, every scheduler (drawn), both in-process
  executors, corrupted drafts (partial acceptance, so rollback is a position reset many times),
  the chain and the tree drafter (a masked block compacted into static slots).
- Static cache, compiled, on every adapter: every model object costs its own compilation (~15 s
  per inductor graph on 2 cores), so qwen2_5_vl keeps one tiny pair (`seeds_of_models=st.just(0)`),
  compiled by inductor, and draws scheduler, executor, γ, prompt and wrong tokens; the other
  adapters compile one model (the target drafting for itself) with dynamo's eager backend
  (dynamo's capture of their code, without AOTAutograd and inductor's C++ build) and run the harness's fixed
  regression examples (partial acceptance, rounds cut by EOS and by the budget) and one drawn case.
  Then sampling on the compiled target: the eager pipeline's draws, seed by seed (the same graphs).
Float64 on CPU, so equality is exact.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from transformers.modeling_outputs import CausalLMOutput

import hippo
from hippo import static
from hippo.errors import ConfigError
from hippo.static import StaticKVSession
from hippo.testing import assert_greedy_lossless
from hippo.testing import models as hm
from hippo.testing import params as hp
from hippo.testing import strategies as hs
from hippo.testing.sampling import COMPILED_TARGET, config_check

# drafting schedulers first: the harness's fixed examples take each draw's first value
SCHEDULERS = sorted(hm.names("schedulers"), key=lambda n: n not in hm.drafting_schedulers())
COMPILED = "qwen2_5_vl"
#: The compiled tests share one xdist worker: a compilation belongs to a model object (`compiled_step`)
#: and the tiny models are cached per process, so COMPILED's pair (seed 0) is compiled once for all
#: three tests (its case of test_compiled_sessions_equal_target_generate among them) instead of once per
#: worker that runs one of them.
SHARED_COMPILATION = pytest.mark.xdist_group("compiled")


def _build(mode: str, roles: tuple[str, ...] = ()):
    def build(case):
        scheduler, drafter = case.extra["scheduler"], case.extra.get("drafter", "chain")
        if drafter == "tree" and scheduler == "serial_tree":
            drafter = "chain"  # serial_tree builds its own trees
        return case.builder(scheduler, drafter=drafter).compile(*roles, mode=mode)

    return build


@pytest.mark.parametrize("adapter", hp.adapter_params())
def test_static_cache_equals_target_generate(adapter):
    assert_greedy_lossless(
        _build("eager"),
        adapters=[adapter],
        examples=hs.examples(0.5),
        executors=("inline", "thread"),
        draws={"scheduler": st.sampled_from(SCHEDULERS), "drafter": st.sampled_from(["chain", "tree"])},
    )


@pytest.mark.parametrize(
    "adapter",
    [
        pytest.param(*p.values, id=p.id, marks=[*p.marks, SHARED_COMPILATION]) if p.id == COMPILED else p
        for p in hp.adapter_params()
    ],
)
def test_compiled_sessions_equal_target_generate(adapter, monkeypatch):
    """Compiled static sessions. Every model object costs its own compilation (~15 s per inductor
    graph on 2 cores), so: on Qwen2.5-VL one tiny pair (target and draft seed 0), compiled by
    inductor, and the scheduler, executor, γ, prompt and wrong tokens drawn; on the other adapters
    the target drafting for itself (one compiled model), the fixed regression examples plus one
    drawn case, compiled by dynamo with its eager backend: the same capture of the backbone's code
    (graph breaks, guards, the dynamic token count, the static cache's writes) that inductor
    compiles, without AOTAutograd's tracing and inductor's C++ build (40 s of 48 on Qwen3-VL's
    tiny target), whose kernels are the backbone's operators and are checked on Qwen2.5-VL."""
    main = adapter == COMPILED
    if not main:
        target = hm.tiny(adapter)
        monkeypatch.setitem(static._STEPS, target, static.CompiledStep(target, backend="eager"))
    assert_greedy_lossless(
        _build("inductor"),
        adapters=[adapter],
        examples=hs.examples(0.3) if main else 1,
        executors=("inline", "thread"),
        draws={"scheduler": st.sampled_from(SCHEDULERS)},
        seeds_of_models=st.just(0),
        self_draft=None if main else True,
    )


@SHARED_COMPILATION
@pytest.mark.skipif(COMPILED not in hm.names("adapters"), reason=f"{COMPILED} adapter not installed")
def test_a_compiled_target_draws_what_the_eager_one_draws():
    """Sampling on a compiled target: the same draws as the eager pipeline, seed by seed
    (`coupled_config_check`: 59 seeds, power >= 0.95 against a 5% TV error; the eager pipeline's law
    is checked at full power by `hippo check --sampling`)."""
    res = config_check({**COMPILED_TARGET, "adapter": COMPILED})
    assert res.power >= 0.95 and res.runs == res.planned and res.distinct > 1, res.summary()


def test_sessions_are_static_and_rollback_is_a_position_reset(monkeypatch):
    """The job's sessions really are static ones (the cache grows when the room runs out); a
    rolled-back session forwards exactly as before."""
    target, draft = hm.tiny(COMPILED), hm.tiny(COMPILED, "draft")
    prompt = hm.Prompt.default(COMPILED, target)
    pipe = hippo.PipelineBuilder().target(target).draft(draft).compile(mode="eager", headroom=1).build()
    grown = []
    reserve = StaticKVSession._reserve

    def spy(self, k):
        before = self.capacity
        reserve(self, k)
        grown.append((self.model, self.capacity > before))

    monkeypatch.setattr(StaticKVSession, "_reserve", spy)
    pipe.generate(prompt.inputs, max_new_tokens=80, min_new_tokens=80, do_sample=False)
    assert {m for m, _ in grown} == {target, draft}

    adapter = pipe.target_adapter
    encoded = adapter.encode(prompt.inputs)
    dynamic = adapter.prefill(encoded, None)
    static = pipe.sessions["target"].open(adapter.prefill(encoded, None), 0)
    L, room = static.length, static.capacity - static.cache_len()
    tokens = torch.tensor(hm.text_ids(target)[:4] * (room // 2))  # [2 room]: more than fits
    first = static.forward(tokens).clone()  # [k, V]
    assert static.capacity >= L + tokens.shape[0] and grown[-1][1]  # the cache grew
    torch.testing.assert_close(first, dynamic.forward(tokens), rtol=1e-12, atol=1e-12)
    static.forward(tokens[:1])
    static.rollback(L)
    assert static.cache_len() == L and static.generated == []
    torch.testing.assert_close(static.forward(tokens), first, rtol=0, atol=0)


def test_compile_options_are_checked():
    b = hippo.PipelineBuilder()
    with pytest.raises(ConfigError, match="roles"):
        b.compile("teacher")
    with pytest.raises(ConfigError, match="mode"):
        b.compile(mode="jit")
    with pytest.raises(ConfigError, match="headroom"):
        b.compile(headroom=0)
    built = hippo.PipelineBuilder.from_config({"compile": {"roles": ["target"], "mode": "eager"}})
    assert built._static["target"].mode == "eager" and built._static["draft"] is None


@SHARED_COMPILATION
@pytest.mark.skipif(COMPILED not in hm.names("adapters"), reason=f"{COMPILED} adapter not installed")
def test_compiled_graphs_are_reused_across_calls():
    """A warm-up inside `torch.inference_mode()` and a later call outside it, with another token
    budget, run the same graphs: nothing recompiles (a recompile costs seconds per call)."""
    from hippo.static import _graphs

    target, draft = hm.tiny(COMPILED, seed=0), hm.tiny(COMPILED, "draft", seed=0)  # the pair compiled above
    prompt = hm.Prompt.default(COMPILED, target)
    pipe = hippo.PipelineBuilder().target(target).draft(draft).scheduler("serial", gamma=3).compile().build()
    with torch.inference_mode():
        pipe.generate(prompt.inputs, max_new_tokens=6, do_sample=False)
    graphs = _graphs()
    out = pipe.generate(prompt.inputs, max_new_tokens=12, do_sample=False)
    assert _graphs() == graphs and out.stats.seconds_compile == 0.0


class _MRoPEToy(torch.nn.Module):
    """A model whose forward broadcasts 3-section positions (`expand(3, -1, -1)`), as Qwen2.5-VL's
    rotary embedding does: k tokens of position_ids [3, 1, k]. Returns a ModelOutput, as transformers'
    models do (dynamo traces it without a graph break)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(11, width), torch.nn.Linear(width, 11)

    def forward(self, input_ids, position_ids, use_cache=True, **cache):
        pos = position_ids.expand(3, -1, -1).float().mean(0)  # [1, k]
        return CausalLMOutput(logits=self.head(self.emb(input_ids) + pos[..., None]))


def _graphs_of(model: torch.nn.Module) -> int:
    """Graphs a compiled step of `model` compiles for k = 3 (a γ = 2 verification), then 1, 2, 5.
    Dynamo's graphs, without inductor's code for them."""
    step, before = static.CompiledStep(model.eval(), backend="eager"), static._graphs()
    for k in (3, 1, 2, 5):
        ids, pos = torch.arange(k)[None], torch.arange(k).expand(3, 1, k).clone()  # [1, k], [3, 1, k]
        logits, _ = step(ids, pos, None)
        torch.testing.assert_close(logits, model(ids, pos).logits, rtol=0, atol=0)
    return static._graphs() - before


def test_a_compiled_step_compiles_one_graph_for_one_token_and_one_for_more():
    """Two graphs: k = 1 and every k >= 2. (Dynamo's duck sizing used to give k the symbol of the
    positions' 3 sections and specialise k = 3: a third graph.)"""
    assert _graphs_of(_MRoPEToy()) == 2


def test_every_compiled_model_gets_its_graphs():
    """Models of one class but other sizes, compiled in one process: each its own two graphs. (On a
    step function shared by all models, dynamo's recompile limit of 8 per code object left the fifth
    model uncompiled, running eagerly without a word.)"""
    assert [_graphs_of(_MRoPEToy(width)) for width in range(4, 10)] == [2] * 6
