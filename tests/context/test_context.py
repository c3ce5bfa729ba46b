"""Video contexts (Pipeline.prepare / ask / conversation): exactness of the cached prefix's
extension, per-question pruning from the cached keys, memory reporting and limits, text questions.

Float64 tiny models on CPU. The lossless property over drawn cases is tests/lossless/test_conversation.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import hippo
from hippo.context import Turn
from hippo.errors import ConfigError, InputError, MemoryBudgetError
from hippo.interfaces import ScoringContext
from hippo.testing import models as hm
from hippo.testing import params as hp
from hippo.testing import reference as hr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ADAPTERS = hp.adapter_params()


def prompt(adapter: str, after: list[int] | None = None, frames: int = 4) -> hm.Prompt:
    target = hm.tiny(adapter)
    unit, words = hm.pixel_unit(target), hm.text_ids(target)
    return hm.Prompt(
        adapter, target, (frames, 2 * unit, 2 * unit), 0, words[3:6], words[7:10] if after is None else after
    )


def pipeline(adapter: str, scheduler: str = "serial", **kw) -> hippo.Pipeline:
    opts = dict(selector="topk", scorer="holistic", keep_ratio=0.3, gamma=3) | kw
    return hr.build_pipeline(hm.tiny(adapter), hm.tiny(adapter, "draft", 1), scheduler=scheduler, **opts)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_the_extension_is_a_full_prefill(adapter):
    """p's logits after the question, and after decoding from there, and the attention scores read
    from the cached keys, equal a prefill of the whole prompt (to float64 rounding): positions,
    rope deltas, deepstack, audio rows and LLaVA's newline row are all right."""
    pipe, full = pipeline(adapter), prompt(adapter)
    ctx = pipe.prepare(full.inputs)
    adapter_ = pipe.target_adapter
    turn = Turn(ctx, full.inputs["input_ids"][0, ctx.length :])
    scorer = pipe.scorer.parts["attention"]
    session = turn.prefill_target(scorer)
    enc = turn.target_encoded()
    ours = scorer.score(enc.visual, ScoringContext(adapter=adapter_, encoded=enc, target=session))
    whole = adapter_.encode(full.inputs)
    with scorer.observe_target_prefill(adapter_, whole):
        ref = adapter_.prefill(whole, None)
    theirs = scorer.score(whole.visual, ScoringContext(adapter=adapter_, encoded=whole, target=ref))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    assert torch.equal(enc.positions, whole.positions) and enc.next_position == whole.next_position
    torch.testing.assert_close(session.last_logits, ref.prompt_logits, rtol=0, atol=1e-10)
    step = torch.tensor([5, 9, 11])
    torch.testing.assert_close(session.forward(step), ref.forward(step), rtol=0, atol=1e-10)


def test_question_independent_work_is_done_once(monkeypatch):
    """Temporal and spatial scores are computed once per video; the draft encodes the video once."""
    from hippo.plugins import scorers

    calls = {"temporal": 0, "spatial": 0, "draft encode": 0}
    for name, cls in (("temporal", scorers.TemporalScorer), ("spatial", scorers.SpatialScorer)):
        orig = cls._score

        def counted(self, visual, orig=orig, name=name):
            calls[name] += 1
            return orig(self, visual)

        monkeypatch.setattr(cls, "_score", counted)
    inline = {"executor": "inline", "executor_options": {"overlap": "off"}}  # counted in this process
    pipe, words = pipeline("qwen2_5_vl", "hippo", executor=inline), hm.text_ids(hm.tiny("qwen2_5_vl"))
    encode = pipe.draft_adapter.encode

    def draft_encode(inputs):
        calls["draft encode"] += 1
        return encode(inputs)

    pipe.draft_adapter.encode = draft_encode
    ctx = pipe.prepare(prompt("qwen2_5_vl").inputs)
    questions = [words[i : i + 3] for i in (0, 5, 9)]
    outs = [pipe.ask(ctx, [151, *q], max_new_tokens=4) for q in questions]
    # hippo's two-phase pruning scores with temporal + spatial, then with the holistic score
    assert calls == {"temporal": 1, "spatial": 1, "draft encode": 1}
    # ... whose question part is the question's own: the kept tokens differ between questions
    assert len({tuple(o.kept_visual_index.tolist()) for o in outs}) > 1
    for q, out in zip(questions, outs):  # and every answer is the target's own
        full = prompt("qwen2_5_vl", q)
        ref = hr.reference(hm.tiny("qwen2_5_vl"), full.inputs, max_new_tokens=4, do_sample=False)
        hr.assert_same(out, ref, full.length)


def test_memory_report_budget_and_close():
    pipe = pipeline("qwen2_5_vl")
    p = prompt("qwen2_5_vl")
    a = pipe.prepare(p.inputs)
    m = a.memory()
    cfg = pipe.target.config.get_text_config()
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert m["kv"] == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * a.length * 8
    assert m["features"] > 0 and m["total"] == a.nbytes == m["kv"] + m["features"] + m["draft_features"]
    pipe.ask(a, [151, 7], max_new_tokens=2)
    assert a.memory()["draft_features"] > 0  # q's encoded video, kept for the next question
    b = pipe.prepare(p.inputs)  # several contexts live at once
    assert {a, b} <= set(pipe._contexts)
    pipe.context_budget = a.nbytes + b.nbytes + 1000
    with pytest.raises(MemoryBudgetError, match="budget"):
        pipe.prepare(p.inputs)
    b.close()
    assert b.nbytes == 0 and b not in set(pipe._contexts)
    with pytest.raises(InputError, match="closed"):
        pipe.ask(b, [151, 7], max_new_tokens=2)
    c = pipe.prepare(p.inputs)  # fits again
    other = pipeline("qwen2_5_vl")
    with pytest.raises(InputError, match="another pipeline"):
        other.ask(c, [151, 7], max_new_tokens=2)
    pipe.close()
    assert a.closed and c.closed


def test_a_prompt_without_video_is_refused():
    pipe = pipeline("qwen2_5_vl")
    with pytest.raises(InputError, match="no video"):
        pipe.prepare({"input_ids": torch.tensor([[5, 6, 7]])})


@pytest.mark.xdist_group("processes")
def test_draft_process_keeps_the_video_encoding(monkeypatch):
    """The process executor's draft gets each question as a `DraftPrefix` of its context (so it
    encodes the video once and keeps it in its own store); every answer is target.generate's."""
    from hippo.plugins import process_executor

    sent = []
    send = process_executor._DraftProcess.send

    def spy(self, cmd, payload):
        if cmd == "job":
            sent.append(payload[-1])
        return send(self, cmd, payload)

    monkeypatch.setattr(process_executor._DraftProcess, "send", spy)
    target = hm.tiny("qwen2_5_vl")
    pipe = pipeline("qwen2_5_vl", "pearl", executor={"executor": "process", "executor_options": {}})
    try:
        ctx = pipe.prepare(prompt("qwen2_5_vl").inputs)
        for after in ([5, 7], [9, 11, 13]):
            full = prompt("qwen2_5_vl", after)
            out = pipe.ask(ctx, full.inputs["input_ids"][0, ctx.length :], max_new_tokens=6)
            hr.assert_same(
                out, hr.reference(target, full.inputs, max_new_tokens=6, do_sample=False), full.length
            )
    finally:
        pipe.close()
    assert [p.key for p in sent] == [ctx.key, ctx.key]
    assert [p.question.tolist()[-3:] for p in sent] == [[151, 5, 7], [9, 11, 13]]


def test_the_encoding_store_encodes_a_prefix_once():
    """`DraftPrefix.encode` through an `EncodingStore` (a draft process's): one encoding per
    context, the least recently used dropped beyond its size, and the question's extension right."""
    from hippo.context import EncodingStore

    pipe, full = pipeline("qwen2_5_vl"), prompt("qwen2_5_vl")
    ctx = pipe.prepare(full.inputs)
    adapter, calls = pipe.draft_adapter, []
    encode = adapter.encode
    adapter.encode = lambda inputs: calls.append(1) or encode(inputs)
    store = EncodingStore(1)
    question = full.inputs["input_ids"][0, ctx.length :]
    prefix = Turn(ctx, question).draft_prefix()
    one, two = prefix.encode(adapter, store), prefix.encode(adapter, store)
    whole = encode(full.inputs)
    assert (
        len(calls) == 1
        and torch.equal(one.embeds, whole.embeds)
        and torch.equal(two.positions, whole.positions)
    )
    attrs.evolve(prefix, key=ctx.key + 1).encode(adapter, store)  # another context: evicts the first
    assert list(store) == [ctx.key + 1] and len(calls) == 2


def test_text_questions_about_a_video_file(tmp_path):
    """From a file: text questions through the chat template; turn 1 equals generate on the inputs
    `video_inputs` builds for that question; turn 2's prompt is the whole conversation rendered by
    the template (the video expanded in place), and its answer is target.generate's on it."""
    pytest.importorskip("av")
    from tiny_checkpoint import save_checkpoint, write_video

    video = write_video(tmp_path / "v.mp4", n=16, fps=8, size=(64, 64))
    p = save_checkpoint(tmp_path / "target", "qwen2_5_vl", "target", seed=0, dtype=torch.float64)
    q = save_checkpoint(tmp_path / "draft", "qwen2_5_vl", "draft", seed=1, dtype=torch.float64)
    pipe = hippo.PipelineBuilder().target(str(p)).draft(str(q)).scorer("holistic").selector("topk").build()
    opts = dict(frames=4, max_pixels=56 * 56)
    ctx = pipe.prepare(video, **opts)
    q1, q2 = "describe the video .", "what is moving ?"
    gen = dict(max_new_tokens=6, do_sample=False)
    one = pipe.video_inputs(video, q1, **opts)
    out = pipe.ask(ctx, q1, **gen)
    with torch.inference_mode():
        assert torch.equal(out.sequences, pipe.target.generate(**one, **gen))
    conv = ctx.conversation()
    a1 = conv.ask(q1, **gen)
    assert torch.equal(a1.sequences, out.sequences)
    a2 = conv.ask(q2, **gen)
    tok = ctx.tokenizer
    answer = tok.decode(a1.sequences[0, one["input_ids"].shape[1] :], skip_special_tokens=True)
    msgs = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": q1}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        {"role": "user", "content": [{"type": "text", "text": q2}]},
    ]
    n = int((one["input_ids"] == 153).sum())
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tok(
        text.replace("<|video_pad|>", "<|video_pad|>" * n), add_special_tokens=False, return_tensors="pt"
    )
    two = dict(one, input_ids=ids["input_ids"], attention_mask=torch.ones_like(ids["input_ids"]))
    two["mm_token_type_ids"] = (two["input_ids"] == 153).long() * 2
    L = two["input_ids"].shape[1]
    assert torch.equal(a2.sequences[0, :L], two["input_ids"][0])
    with torch.inference_mode():
        assert torch.equal(a2.sequences, pipe.target.generate(**two, **gen))
    with pytest.raises(InputError, match="empty"):
        pipe.ask(ctx, "  ")


def test_a_prompt_over_the_budget_is_refused_before_any_work(monkeypatch):
    """generate refuses a prompt whose KV and features would pass the budget beside the live contexts,
    with a MemoryBudgetError naming both, before the vision encoder or the target runs."""
    pipe = pipeline("qwen2_5_vl")
    p = prompt("qwen2_5_vl")
    ctx = pipe.prepare(p.inputs)
    pipe.context_budget = ctx.nbytes + 100  # the context fits; a prompt of its length beside it cannot

    def forbidden(*args, **kwargs):
        raise AssertionError("the model ran")

    monkeypatch.setattr(pipe.target_adapter, "encode", forbidden)
    with pytest.raises(MemoryBudgetError, match=r"a prompt of \d+ tokens needs about .* 1 live context"):
        pipe.generate(p.inputs, max_new_tokens=2)
    ctx.close()
    monkeypatch.undo()
    pipe.context_budget = None
    assert pipe.generate(p.inputs, max_new_tokens=2).sequences.shape[1] == p.length + 2
    pipe.close()


@pytest.mark.parametrize("adapter", ADAPTERS)
@settings(max_examples=3, deadline=None)
@given(rows=st.integers(1, 12))
@example(rows=10_000)
def test_a_prefill_in_pieces_is_the_prefill(adapter, rows):
    """`prepare_steps` with `prefill_rows`: the target's prefill runs in pieces of `rows` rows, with
    another question's forward on the same model between two pieces (as a server would decode its
    live rows there); rows past the prompt give one piece. The context's KV, its logits, the attention scorer's capture and an answer from
    it equal those of a prefill in one piece (float64)."""
    pipe, p = pipeline(adapter), prompt(adapter)
    whole = pipe.prepare(p.inputs)
    other = Turn(pipe.prepare(p.inputs), torch.tensor(hm.text_ids(hm.tiny(adapter))[:3]))
    steps = pipe.prepare_steps(p.inputs, prefill_rows=rows)
    pauses = 0
    for ctx in steps:
        if ctx is None:
            pauses += 1
            other.prefill_target(pipe.scorer).close()  # the scorer observes another forward here
    P = whole.length
    assert pauses == (-(-P // rows) if rows < P else 0)  # after encoding, then between the pieces
    torch.testing.assert_close(ctx.prefix_logits, whole.prefix_logits, rtol=0, atol=1e-10)
    for a, b in zip(ctx.cache.layers, whole.cache.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-10)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=1e-10)
    ours, theirs = ctx.capture, whole.capture
    assert torch.equal(ours.rows, theirs.rows) and ours.hidden.keys() == theirs.hidden.keys()
    for layer in theirs.hidden:
        torch.testing.assert_close(ours.hidden[layer], theirs.hidden[layer], rtol=0, atol=1e-10)
    question = hm.text_ids(hm.tiny(adapter))[4:7]
    a, b = (pipe.ask(c, question, max_new_tokens=4, do_sample=False) for c in (ctx, whole))
    assert a.sequences.tolist() == b.sequences.tolist()
    assert a.kept_visual_index.tolist() == b.kept_visual_index.tolist()


def test_prefill_rows_must_be_positive():
    with pytest.raises(ConfigError, match="prefill_rows"):
        pipeline("qwen2_5_vl").prepare_steps(prompt("qwen2_5_vl").inputs, prefill_rows=0)
