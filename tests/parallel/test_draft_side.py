"""The draft side wherever an executor puts it: adapter options reach a draft process, token trees
survive every transport, and a forked policy is the same wherever it is unpickled.

(Greedy exactness and the sampling law of trees under `pearl` and `hippo` on the in-process
executors are in tests/lossless/test_tree.py.)
"""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_parallel import make_inputs, models, no_leaks  # noqa: F401 - no_leaks is a fixture

import hippo
from hippo.adapters.qwen2_5_vl import Qwen25VLAdapter
from hippo.sampling import TokenPolicy

pytestmark = pytest.mark.xdist_group("processes")  # draft processes: with tests/parallel/test_parallel.py


class RefusingAdapter(Qwen25VLAdapter):
    """Qwen2.5-VL with an extra option: when `refuse` is set, its prefill raises with that message."""

    name = "test-refusing"

    def __init__(self, model: torch.nn.Module, *, refuse: str | None = None):
        super().__init__(model)
        self.refuse = refuse

    def prefill(self, encoded, keep):
        if self.refuse is not None:
            raise RuntimeError(self.refuse)
        return super().prefill(encoded, keep)


def test_adapters_record_the_options_they_were_built_with():
    target, _ = models()
    assert Qwen25VLAdapter(target).options == {}
    adapter = RefusingAdapter(target, refuse="no")
    assert adapter.options == {"refuse": "no"}
    assert RefusingAdapter(target).options == {}  # defaults are the class's, not recorded
    rebuilt = type(adapter)(target, **adapter.options)
    assert rebuilt.refuse == "no" and rebuilt.options == adapter.options
    adapter.options["refuse"] = "changed"  # a copy: the adapter's record cannot be edited
    assert adapter.options == {"refuse": "no"}


class _RefusingPlugin:
    @hippo.hookimpl
    def hippo_register_adapters(self) -> dict[str, type]:
        return {RefusingAdapter.name: RefusingAdapter}


@pytest.fixture
def refusing_adapter():
    pm = hippo.plugin_manager()
    plugin = _RefusingPlugin()
    pm.register(plugin, name="test-refusing-adapter")
    yield RefusingAdapter.name
    pm.unregister(plugin)


def test_adapter_options_reach_the_draft_process(refusing_adapter, no_leaks):  # noqa: F811
    """The draft process rebuilds the draft's adapter with all of its options (it used to guess)."""
    target, draft = models()
    inputs = make_inputs(2, 56, 56, 8)
    ref = target.generate(**inputs, max_new_tokens=6, do_sample=False)
    pipe = (
        hippo.PipelineBuilder()
        .target(target)
        .draft(draft, backbone=refusing_adapter, adapter_options={"refuse": "option arrived"})
        .selector("uniform", keep_ratio=0.3)
        .scheduler("pearl", executor="process")
        .build()
    )
    assert pipe.draft_adapter.options == {"refuse": "option arrived"}
    out = pipe.generate(inputs, max_new_tokens=6, do_sample=False)
    assert torch.equal(out.sequences, ref)
    assert out.stats.fallback and "option arrived" in out.stats.notes[0]
    pipe.close()


def tree_pipeline(scheduler: str, self_spec: bool, keep_ratio: float, tree: dict | None = None, **options):
    target, draft = models()
    return (
        hippo.PipelineBuilder()
        .target(target)
        .draft(target if self_spec else draft)
        .selector("uniform", keep_ratio=keep_ratio)
        .drafter("tree", **(tree or {}))
        .scheduler(scheduler, **options)
        .build()
    )


@pytest.mark.parametrize("scheduler", ["pearl", "hippo"])
def test_trees_travel_through_the_draft_process(scheduler, no_leaks):  # noqa: F811
    """A tree drafted in the child process reaches the target whole (not as its first-child chain)."""
    target, _ = models()
    inputs = make_inputs(2, 56, 84, 9)
    ref = target.generate(**inputs, max_new_tokens=14, do_sample=False)
    with tree_pipeline(scheduler, True, 1.0, executor="process") as pipe:
        out = pipe.generate(inputs, max_new_tokens=14, do_sample=False)
    assert torch.equal(out.sequences, ref)
    s = out.stats
    assert not s.fallback, s.notes
    # the draft is the target with every visual token: off-path nodes can only come from trees
    assert any(g > n for n, g in zip(s.accepted_per_round, s.drafted_per_round)), s.as_dict()


durations = st.floats(min_value=0.1, max_value=30.0, allow_nan=False)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scheduler=st.sampled_from(["pearl", "hippo"]),
    self_spec=st.booleans(),
    gamma=st.integers(1, 5),
    budget=st.sampled_from([0, 3, 8]),
    timing=st.tuples(durations, durations, durations, durations),
    max_new=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
def test_trees_lossless_under_any_interleaving(scheduler, self_spec, gamma, budget, timing, max_new, seed):
    """The simulated clock stops tree drafting at any node (a truncated tree is still a tree)."""
    target, _ = models()
    inputs = make_inputs(2, 56, 56, seed)
    tp, tf, dp, df = timing
    pipe = tree_pipeline(
        scheduler,
        self_spec,
        0.4,
        {"budget": budget, "top_k": 2},
        gamma=gamma,
        executor="simulated",
        executor_options={
            "target_prefill": tp,
            "target_forward": tf,
            "draft_prefill": dp,
            "draft_forward": df,
        },
    )
    out = pipe.generate(inputs, max_new_tokens=max_new, do_sample=False)
    ref = target.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    assert torch.equal(out.sequences, ref)


def test_a_forked_policy_is_the_same_after_pickling():
    """The draft process receives the forked policy itself: its generator's state travels with it."""
    parent = TokenPolicy([], True, torch.Generator().manual_seed(5), vocab_size=11)
    twin = TokenPolicy([], True, torch.Generator().manual_seed(5), vocab_size=11)
    forked, forked_twin = parent.fork(), twin.fork()
    remote = pickle.loads(pickle.dumps(forked))
    assert remote.vocab_size == 11 and remote.do_sample
    draws = [remote.uniform() for _ in range(4)]
    assert draws == [forked_twin.uniform() for _ in range(4)]
    assert draws != [parent.uniform() for _ in range(4)]  # its own stream, not the parent's
