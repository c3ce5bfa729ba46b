"""Log-probabilities of the emitted tokens (`DecodeJob.logprobs`): p's own, exactly, on every path
that emits (the first token, a target step, a verified round, batched or alone), equal in float64 to
log_softmax of the raw logits Hugging Face `generate` returns for the same greedy answer."""

from __future__ import annotations

import pytest
import torch

import hippo
from hippo.media.inputs import load_video_inputs

pytest.importorskip("av")
from tiny_checkpoint import save_checkpoint, write_video  # noqa: E402

TOP = 3
#: HF `generate` hands its logits back cast to float32 (`output_logits`), so its log-probs are a
#: float32 rounding of p's float64 ones (differences of a few 1e-8 here)
TOL = 1e-6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    return {
        "target": save_checkpoint(root / "target", dtype=torch.float64),
        "draft": save_checkpoint(root / "draft", role="draft", seed=1, dtype=torch.float64),
        "videos": [write_video(root / "a.mp4", n=8), write_video(root / "b.mp4", n=12)],
    }


def reference(pipe, inputs, new_tokens):
    """(tokens, [(log-prob of each, its top-TOP (id, log-prob))]) from HF generate's raw logits."""
    L = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        out = pipe.target.generate(
            **inputs,
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, L:].tolist()
    lps = [torch.log_softmax(x[0].double(), -1) for x in out.logits]  # [V] per step
    return tokens, [
        (float(lp[t]), list(zip(lp.topk(TOP).indices.tolist(), lp.topk(TOP).values.tolist())))
        for t, lp in zip(tokens, lps)
    ]


def assert_same(got, want, tol=TOL):
    assert len(got) == len(want)
    for (lp, top), (lp_ref, top_ref) in zip(got, want):
        assert lp == pytest.approx(lp_ref, abs=tol)
        assert [i for i, _ in top] == [i for i, _ in top_ref]
        assert [v for _, v in top] == pytest.approx([v for _, v in top_ref], abs=tol)


@pytest.mark.parametrize("scheduler, gamma", [("serial", 3), ("autoregressive", None)])
def test_logprobs_equal_hf_generates_raw_logits_batched_and_alone(pair, scheduler, gamma):
    b = hippo.PipelineBuilder().target(str(pair["target"]), dtype=torch.float64).scheduler(scheduler)
    if gamma is not None:
        b = b.draft(str(pair["draft"]), dtype=torch.float64).scheduler(scheduler, gamma=gamma)
    pipe = b.build()
    prompts = ["describe the video .", "what happens ?"]
    inputs = [
        load_video_inputs(pipe.target_adapter, v, q, max_pixels=3136) for v, q in zip(pair["videos"], prompts)
    ]
    refs = [reference(pipe, x, 10) for x in inputs]
    # batched: two rows in one engine
    jobs = [pipe.job(x, max_new_tokens=10, do_sample=False) for x in inputs]
    for job in jobs:
        job.logprobs = TOP
    pipe.engine().run(jobs)
    for job, (tokens, lps) in zip(jobs, refs):
        assert job.tokens == tokens
        assert_same(job.token_logprobs, lps)
    # alone (`generate`'s path): the job's own sessions and drafter
    job = pipe.job(inputs[0], max_new_tokens=10, do_sample=False)
    job.logprobs = TOP
    from hippo.engine import decode_alone

    decode_alone(pipe.scheduler, job)
    job.finish()
    assert job.tokens == refs[0][0]
    assert_same(job.token_logprobs, refs[0][1])


def test_no_logprobs_are_computed_unless_asked_for(pair):
    pipe = (
        hippo.PipelineBuilder().target(str(pair["target"]), dtype=torch.float64).scheduler("autoregressive")
    )
    pipe = pipe.build()
    x = load_video_inputs(pipe.target_adapter, pair["videos"][0], "what happens ?", max_pixels=3136)
    job = pipe.job(x, max_new_tokens=4, do_sample=False)
    pipe.engine().run([job])
    assert job.tokens and job.token_logprobs == []
    job = pipe.job(x, max_new_tokens=4, do_sample=False)
    job.logprobs = 0
    pipe.engine().run([job])
    assert len(job.token_logprobs) == len(job.tokens) and all(top == [] for _, top in job.token_logprobs)


@pytest.mark.parametrize("scheduler", ["serial_tree", "pearl"])
def test_logprobs_of_tree_rounds_and_parallel_schedules(pair, scheduler, monkeypatch):
    """`generate` with token trees (the accepted path's rows, siblings skipped) and PEARL's
    post-verify (a round without its bonus token): the same log-probs as HF generate's logits."""
    from hippo.job import DecodeJob

    jobs = []
    init = DecodeJob.__init__

    def asking(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.logprobs = TOP
        jobs.append(self)

    monkeypatch.setattr(DecodeJob, "__init__", asking)
    target = str(pair["target"])
    pipe = (
        hippo.PipelineBuilder()
        .target(target, dtype=torch.float64)
        .draft(target, dtype=torch.float64)  # the target drafts for itself: long accepted paths
        .drafter("tree")
        .scorer("holistic")
        .selector("topk", keep_ratio=1.0)
        .scheduler(scheduler, gamma=3)
        .build()
    )
    x = load_video_inputs(pipe.target_adapter, pair["videos"][1], "describe the video .", max_pixels=3136)
    tokens, lps = reference(pipe, x, 12)
    out = pipe.generate(x, do_sample=False, max_new_tokens=12)
    assert out.sequences[0, x["input_ids"].shape[1] :].tolist() == tokens
    s = out.stats
    assert s.accepted_per_round and max(s.accepted_per_round) > 0
    assert any(g > n for n, g in zip(s.accepted_per_round, s.drafted_per_round))  # siblings skipped
    assert_same(jobs[-1].token_logprobs, lps)
