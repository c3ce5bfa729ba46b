"""pearl and hippo: lossless on every executor, whatever the interleaving; fault tolerance; clean shutdown.

The simulated executor lets hypothesis choose every forward's duration, which decides how many
tokens the draft buffers during the target's prefill and how far an aborted drafting got.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import threading
import time
from types import SimpleNamespace

import attrs
import pytest
import torch
from hypothesis import strategies as st

import hippo
from hippo.adapters.qwen2_5_vl_tiny import synthetic_inputs, tiny_model
from hippo.plugins.drafters import ChainDrafter
from hippo.plugins.executors import InlineExecutor
from hippo.testing import assert_greedy_lossless, replay_greedy
from hippo.testing import models as hm
from hippo.testing import strategies as hs
from hippo.testing.greedy import regression_cases
from hippo.testing.reference import path_logits
from hippo.testing.strategies import examples

# draft processes, threads whose overlap is measured, timeouts: one worker, one test at a time
pytestmark = pytest.mark.xdist_group("processes")

_MODELS: dict = {}


def models():
    if not _MODELS:
        _MODELS["target"] = tiny_model("target", seed=0, dtype=torch.float64)
        _MODELS["draft"] = tiny_model("draft", seed=1, dtype=torch.float64)
    return _MODELS["target"], _MODELS["draft"]


def make_inputs(frames: int, h: int, w: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    target, _ = models()
    text = torch.randint(3, 140, (6,), generator=g).tolist()
    return synthetic_inputs(target, torch.rand(frames, h, w, 3, generator=g), [1, *text[:3]], text[3:])


def build(scheduler: str, self_spec: bool, keep_ratio: float = 0.3, **options):
    target, draft = models()
    return (
        hippo.PipelineBuilder()
        .target(target)
        .draft(target if self_spec else draft)
        .selector("uniform", keep_ratio=keep_ratio)
        .scheduler(scheduler, **options)
        .build()
    )


def test_greedy_lossless_under_any_interleaving():
    """hippo.testing's check with the simulated executor: hypothesis chooses every forward's virtual
    duration (`case.timing`), hence how many tokens the draft buffers during the target's prefill
    and how far an aborted drafting got."""

    def build(case):
        x = case.extra
        return case.builder(
            x["scheduler"], executor="simulated", prune=x["prune"], auto_gamma=x["auto_gamma"]
        ).selector("uniform", keep_ratio=x["keep ratio"])

    def check(case, out):
        s = out.stats  # out.sequences is already checked equal to target.generate's
        assert s.new_tokens == out.sequences.shape[1] - case.prompt.length
        assert 0.0 <= s.draft_hidden_fraction <= 1.0 + 1e-9

    assert_greedy_lossless(
        build,
        adapters="qwen2_5_vl",
        examples=examples(1.0),
        executors=("simulated",),
        draws={
            "scheduler": st.sampled_from(["pearl", "hippo"]),
            "prune": st.sampled_from(["late", "early", "two_phase"]),
            "auto_gamma": st.booleans(),
            "keep ratio": st.sampled_from([1.0, 0.4, 0.1]),
        },
        on_output=check,
    )


def _process_build(case):
    return case.builder(case.extra["scheduler"], prune=case.extra["prune"])


PROCESS_ADAPTERS = hm.tiny_adapters()


def test_process_executor_in_the_harness(no_leaks):
    """hippo.testing's check with the draft in its own process (a spawn per pipeline): pearl and
    hippo, the prune mode and γ drawn (fixed or "auto"), corrupted drafts, the adapters' tiny
    pairs drawn; every draft process is gone afterwards."""
    assert_greedy_lossless(
        _process_build,
        adapters=PROCESS_ADAPTERS,
        examples=max(1, examples(0.1)),
        executors=("process",),
        gamma=hs.gammas_or_auto,
        draws={"scheduler": st.sampled_from(["hippo", "pearl"]), "prune": st.sampled_from(["late", "early"])},
    )


def test_process_executor_takes_a_llava_model_that_has_run(no_leaks):
    """A LLaVA-OneVision model that has run a forward holds transformers' output-capturing hooks
    (local functions); the process executor takes them off before it pickles the model."""
    case = regression_cases("llava_onevision", "process")[0]
    replay_greedy(_process_build, attrs.evolve(case, extra={"scheduler": "hippo", "prune": "late"}))


def test_sync_prefill_buffers_while_the_target_prefills():
    """A slow target prefill lets hippo's draft buffer tokens that the target then verifies first."""
    target, _ = models()
    inputs = make_inputs(2, 56, 56, 0)
    slow = {"target_prefill": 50.0, "target_forward": 5.0, "draft_prefill": 1.0, "draft_forward": 1.0}
    out = build("hippo", True, 1.0, executor="simulated", executor_options=slow).generate(
        inputs, max_new_tokens=30, do_sample=False
    )
    # buffered up to the token budget during the prefill: p's first token (from its prefill) was the
    # buffer's first, so the first round verifies the rest but the last token, which p emits itself
    assert out.stats.drafted_per_round[0] == 30 - 2
    fast = {**slow, "target_prefill": 0.5}
    out2 = build("hippo", True, 1.0, executor="simulated", executor_options=fast).generate(
        inputs, max_new_tokens=30, do_sample=False
    )
    assert torch.equal(out.sequences, out2.sequences)
    assert out2.stats.drafted_per_round[0] < 30
    assert out.stats.draft_hidden_fraction > 0.5  # the buffered drafting ran behind the prefill


@pytest.mark.parametrize("scheduler", ["pearl", "hippo"])
def test_sampling_is_seeded_and_stays_in_support(scheduler):
    """A seeded run repeats; every sampled token is in the target's top-5 after the tokens before
    it (p's own logits along the path, from transformers' generate: the support of its law)."""
    target, _ = models()
    inputs = make_inputs(2, 56, 56, 1)
    L = inputs["input_ids"].shape[1]
    pipe = build(scheduler, True, executor="simulated")  # the target drafts from a pruned video
    a = pipe.generate(inputs, max_new_tokens=12, do_sample=True, top_k=5, seed=7)
    b = pipe.generate(inputs, max_new_tokens=12, do_sample=True, top_k=5, seed=7)
    assert torch.equal(a.sequences, b.sequences)
    tokens = a.sequences[0, L:].tolist()
    rows = path_logits(target, inputs, tokens)  # [new + 1, V]: p's logits before each token
    support = rows[: len(tokens)].topk(5, dim=-1).indices  # [new, 5]
    outside = [(i, t) for i, t in enumerate(tokens) if t not in support[i].tolist()]
    assert not outside, f"sampled outside the target's top-5 at (position, token) {outside}"
    assert sum(a.stats.accepted_per_round) > 0  # drafted tokens were accepted, not only resampled


# ---- the process executor -----------------------------------------------------------------------


def children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


@pytest.fixture
def no_leaks():
    before = children()
    yield
    gc.collect()
    deadline = time.monotonic() + 10
    while children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (children() - before), "draft processes were left running"


@pytest.mark.parametrize("scheduler", ["pearl", "hippo"])
def test_process_executor_is_lossless_and_reusable(scheduler, no_leaks):
    target, _ = models()
    inputs = make_inputs(3, 56, 84, 2)
    ref = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    with build(scheduler, True, executor="process") as pipe:
        for _ in range(2):  # the draft process is started once and reused
            out = pipe.generate(inputs, max_new_tokens=16, do_sample=False)
            assert torch.equal(out.sequences, ref)
            assert not out.stats.fallback
            assert out.stats.seconds_draft_decode > 0
        pid = pipe.scheduler.executor.pid
        assert pid is not None
    assert pipe.scheduler.executor.pid is None


def test_draft_processes_start_from_a_fork_server_that_preloads_the_draft():
    """Where the platform has a fork server, draft processes are forked from it, and it imports the
    process executor and the model's module once, not in each draft process."""
    from multiprocessing import forkserver

    from plugins.process_executor import _context

    target, _ = models()
    ctx = _context(target, type(target))
    if "forkserver" not in multiprocessing.get_all_start_methods():
        assert ctx.get_start_method() == "spawn"
        return
    assert ctx.get_start_method() == "forkserver"
    preload = set(forkserver._forkserver._preload_modules)
    assert {"plugins.process_executor", type(target).__module__} <= preload


def test_draft_process_killed_mid_generation(no_leaks, caplog, monkeypatch):
    target, _ = models()
    inputs = make_inputs(3, 56, 84, 3)
    ref = target.generate(**inputs, max_new_tokens=20, do_sample=False)
    pipe = build("hippo", True, executor="process")
    from hippo.plugins import process_executor

    calls = {"n": 0}
    original = process_executor.ProcessDraftWorker.submit

    def submit_then_die(self, prefix, gamma):
        calls["n"] += 1
        if calls["n"] == 4:  # a few rounds in: kill -9 the draft
            os.kill(self.dp.proc.pid, signal.SIGKILL)
        return original(self, prefix, gamma)

    monkeypatch.setattr(process_executor.ProcessDraftWorker, "submit", submit_then_die)
    with caplog.at_level(logging.WARNING, logger="hippo"):
        out = pipe.generate(inputs, max_new_tokens=20, do_sample=False)
    assert torch.equal(out.sequences, ref)  # accepted tokens kept, the target finished alone
    assert out.stats.fallback and "draft" in out.stats.notes[0]
    assert any("target alone" in r.message for r in caplog.records)
    assert sum(out.stats.accepted_per_round) + out.stats.rounds > 0  # some rounds ran before the kill
    monkeypatch.undo()
    out2 = pipe.generate(inputs, max_new_tokens=20, do_sample=False)  # a fresh draft process
    assert torch.equal(out2.sequences, ref) and not out2.stats.fallback
    pipe.close()


@attrs.frozen
class _FaultConfig:
    mode: str = "raise"
    after: int = 2


class FaultyDrafter(ChainDrafter):
    """Raises or hangs on its `after`-th proposal (in the draft process)."""

    Config = _FaultConfig
    calls = 0

    def propose(self, session, prefix, gamma, policy, should_stop=None):
        FaultyDrafter.calls += 1
        if FaultyDrafter.calls >= self.config.after:
            if self.config.mode == "raise":
                raise RuntimeError("injected draft failure")
            time.sleep(3600)
        return super().propose(session, prefix, gamma, policy, should_stop)


class _FaultPlugin:
    @hippo.hookimpl
    def hippo_register_drafters(self):
        return {"faulty": FaultyDrafter}


@pytest.fixture
def faulty_drafter():
    pm = hippo.plugin_manager()
    plugin = _FaultPlugin()
    pm.register(plugin, name="test-faulty-drafter")
    yield
    pm.unregister(plugin)


@pytest.mark.parametrize("mode, timeout", [("raise", 60.0), ("hang", 3.0)])
def test_draft_that_raises_or_hangs(mode, timeout, faulty_drafter, no_leaks):
    target, _ = models()
    inputs = make_inputs(2, 56, 56, 4)
    ref = target.generate(**inputs, max_new_tokens=12, do_sample=False)
    pipe = (
        hippo.PipelineBuilder()
        .target(target)
        .draft(target)
        .selector("uniform", keep_ratio=0.3)
        .drafter("faulty", mode=mode, after=3)
        .scheduler("pearl", executor="process", executor_options={"timeout": timeout})
        .build()
    )
    out = pipe.generate(inputs, max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, ref)
    assert out.stats.fallback
    assert ("injected" in out.stats.notes[0]) if mode == "raise" else ("no answer" in out.stats.notes[0])
    pipe.close()


def test_two_pipelines_in_sequence_and_gc(no_leaks):
    target, draft = models()
    inputs = make_inputs(2, 56, 56, 5)
    ref = target.generate(**inputs, max_new_tokens=10, do_sample=False)
    for scheduler in ("pearl", "hippo"):
        pipe = build(scheduler, False, executor="process")
        assert torch.equal(pipe.generate(inputs, max_new_tokens=10, do_sample=False).sequences, ref)
        pid = pipe.scheduler.executor.pid
        del pipe  # no close(): garbage collection must stop the draft process
        gc.collect()
        deadline = time.monotonic() + 10
        while pid in children() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid not in children()


_ORPHAN_SCRIPT = """
import os, signal, sys, torch
import hippo
from hippo.testing import assert_greedy_lossless
from hippo.testing import strategies as hs
from hippo.testing.strategies import examples
from hippo.adapters.qwen2_5_vl_tiny import synthetic_inputs, tiny_model
target, draft = tiny_model("target", seed=0), tiny_model("draft", seed=1)
inputs = synthetic_inputs(target, torch.rand(2, 56, 56, 3), [1, 5, 6], [7, 8])
pipe = hippo.PipelineBuilder().target(target).draft(draft).scheduler("pearl", executor="process").build()
pipe.generate(inputs, max_new_tokens=4, do_sample=False)
print(pipe.scheduler.executor.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close(), no finaliser, no atexit
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_draft_process_exits_when_its_parent_is_killed():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _ORPHAN_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pid = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 15
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _running(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the draft process outlived its killed parent")


# ---- inline with overlap="thread": the draft on a thread (and a CUDA stream on GPU) -------------
# Greedy exactness and the sampling law of this mode are in the lossless harness
# (`h.executor_choices`); here: that the overlap is real and measured, that a failing draft
# thread falls back to the target, and that no thread outlives its pipeline.

THREAD = {"executor": "inline", "executor_options": {"overlap": "thread"}}


def draft_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hippo-draft")]


@pytest.mark.parametrize(
    "overlap, self_spec, threaded",
    [("auto", False, False), ("off", False, False), ("thread", False, True), ("thread", True, False)],
)
def test_when_the_draft_gets_a_thread(overlap, self_spec, threaded):
    """On CPU, "auto" stays sequential; a model drafting for itself never runs two forwards at once."""
    target, draft = models()
    pipe = build("hippo", self_spec, executor="inline", executor_options={"overlap": overlap})
    assert isinstance(pipe.scheduler.executor, InlineExecutor)
    job = SimpleNamespace(pipeline=pipe)  # `threaded` reads the job's pipeline's adapters
    assert pipe.scheduler.executor.threaded(job) is threaded


@pytest.mark.parametrize("scheduler", ["pearl", "hippo"])
def test_thread_overlap_is_lossless_and_measured(scheduler):
    target, _ = models()
    inputs = make_inputs(3, 56, 84, 6)
    ref = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    pipe = build(scheduler, False, **THREAD)
    hidden = []
    for _ in range(3):
        out = pipe.generate(inputs, max_new_tokens=24, do_sample=False)
        assert torch.equal(out.sequences, ref)
        s = out.stats
        assert not s.fallback and s.seconds_draft_decode > 0 and s.seconds_draft_prefill > 0
        assert 0.0 <= s.draft_hidden_fraction <= 1.0 + 1e-9
        hidden.append(s.seconds_draft_overlapped)
    assert max(hidden) > 0  # the draft's work and the target's really ran at the same time
    pipe.close()
    assert not draft_threads()


def test_draft_thread_that_raises_falls_back_to_the_target(faulty_drafter):
    target, draft = models()
    inputs = make_inputs(2, 56, 56, 4)
    ref = target.generate(**inputs, max_new_tokens=12, do_sample=False)
    FaultyDrafter.calls = 0
    pipe = (
        hippo.PipelineBuilder()
        .target(target)
        .draft(draft)
        .selector("uniform", keep_ratio=0.3)
        .drafter("faulty", mode="raise", after=3)
        .scheduler("hippo", **THREAD)
        .build()
    )
    out = pipe.generate(inputs, max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, ref)
    assert out.stats.fallback and "injected draft failure" in out.stats.notes[0]
    assert "thread" in out.stats.notes[0]
    pipe.close()
    assert not draft_threads()


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["pearl", "hippo"])
def test_cuda_draft_runs_on_its_own_stream(scheduler):
    """On a GPU, "auto" picks the thread and a side stream; outputs are the target's own."""
    target, draft = (m.to("cuda") for m in models())
    try:
        inputs = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in make_inputs(3, 56, 84, 7).items()}
        ref = target.generate(**inputs, max_new_tokens=24, do_sample=False)
        pipe = build(scheduler, False, executor="inline")
        streams = []
        original = InlineExecutor.open

        def spy(self, job):
            worker = original(self, job)
            streams.append(getattr(worker, "stream", None))
            return worker

        InlineExecutor.open = spy
        try:
            out = pipe.generate(inputs, max_new_tokens=24, do_sample=False)
        finally:
            InlineExecutor.open = original
        assert torch.equal(out.sequences.cpu(), ref.cpu())
        assert streams and isinstance(streams[0], torch.cuda.Stream)
        assert streams[0] != torch.cuda.current_stream()
        pipe.close()
    finally:
        for m in (target, draft):
            m.to("cpu")


@pytest.mark.parametrize(
    "self_spec, cores, name, options",
    [
        (False, 1, "inline", {"overlap": "off"}),
        (False, 2, "inline", {"overlap": "off"}),  # measured fastest on 2 cores: both models sequential
        (True, 4, "inline", {"overlap": "off"}),
        (False, 4, "process", {"threads": 2, "prefill_threads": 4}),
        (False, 6, "process", {"threads": 3, "prefill_threads": 6}),
    ],
)
def test_auto_executor_chooses_by_machine(self_spec, cores, name, options):
    """`executor="auto"` on CPU: one after the other for a self-drafting model, under 4 cores, or
    when sampling; else a draft process on half the cores, the target's prefill on all of them."""
    from hippo.plugins.auto_executor import choose

    pipe = build("hippo", self_spec, executor="auto")
    greedy, sampling = (
        SimpleNamespace(pipeline=pipe, policy=SimpleNamespace(do_sample=s)) for s in (False, True)
    )
    assert choose(greedy, cores) == (name, options)
    assert choose(sampling, cores) == ("inline", {"overlap": "off"})  # a seeded run repeats exactly


def test_auto_executor_refuses_options_for_an_executor_it_never_picks():
    with pytest.raises(hippo.errors.ConfigError, match="only chooses among inline, process"):
        build("hippo", False, executor="auto", executor_options={"options": {"proces": {"timeout": 1}}})


def test_auto_executor_runs_a_draft_process_losslessly(no_leaks):
    """The chosen process executor runs (as on 4 cores: 2 threads each, the prefill on 4); output
    unchanged."""
    from hippo.plugins.process_executor import ProcessExecutor

    target, _ = models()
    inputs = make_inputs(3, 56, 84, 4)
    ref = target.generate(**inputs, max_new_tokens=12, do_sample=False)
    options = {"cores": 4, "options": {"process": {"timeout": 60}}}
    with build("hippo", False, executor="auto", executor_options=options) as pipe:
        out = pipe.generate(inputs, max_new_tokens=12, do_sample=False)
        assert torch.equal(out.sequences, ref) and not out.stats.fallback
        ex = pipe.scheduler.executor
        assert isinstance(ex.chosen, ProcessExecutor) and ex.chosen.config.timeout == 60
        assert ex.pid is not None and ex.chosen.config.prefill_threads == 4
    assert ex.pid is None


def test_a_parallel_batch_leaves_no_draft_thread():
    """`generate_batch` with `pearl` drafts beside the target on a thread of the engine's, which it
    stops when the batch is done (`Engine.close`)."""
    target, _ = models()
    pipe = build("pearl", False, **THREAD)
    xs = [make_inputs(2, 56, 56, seed) for seed in (7, 8)]
    outs = pipe.generate_batch(xs, max_new_tokens=6, do_sample=False)
    for out, x in zip(outs, xs):
        assert torch.equal(out.sequences, target.generate(**x, max_new_tokens=6, do_sample=False))
    assert "the draft drafted beside the target (pre-/post-verify)" in outs[0].stats.notes
    assert not [t for t in threading.enumerate() if t.name.startswith("hippo-batch-draft")]
    pipe.close()


def test_small_tensors_cross_the_draft_queues_by_value_large_ones_through_shared_memory():
    """What the process executor puts on its queues comes back equal (dtype, shape, values), whatever
    the tensor's dtype, shape or strides; a CPU tensor up to `INLINE_BYTES` travels inside the pickle
    (no shared-memory file descriptor, which costs a socket connection to receive), a larger one
    does not, and a draft proposal's fields keep their types."""
    import pickle

    from hippo.plugins.process_executor import INLINE_BYTES, _pack
    from hippo.proposal import DraftProposal

    small = [
        torch.tensor(7),
        torch.empty(0, 5),
        torch.tensor([True, False, True]),
        torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        torch.arange(24, dtype=torch.float64).reshape(4, 6).t(),  # not contiguous
        torch.arange(100)[10:40:3],  # a strided view into a larger storage
    ]
    for x in small:
        data = _pack(("ok", 1, x))
        y = pickle.loads(data)[2]
        assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(y, x)
        assert not y.is_shared()
    big = torch.randn(INLINE_BYTES // 4 + 1)
    data = _pack(big.clone())
    assert len(data) < INLINE_BYTES  # its storage went to shared memory, not into the pickle
    assert torch.equal(pickle.loads(data), big)
    prop = DraftProposal(torch.tensor([3, 1, 4]), torch.softmax(torch.randn(3, 9), -1))
    back = pickle.loads(_pack(prop))
    assert isinstance(back, DraftProposal) and back.chain
    assert torch.equal(back.tokens, prop.tokens) and torch.equal(back.q, prop.q)
