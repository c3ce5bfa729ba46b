"""`hippo eval` (lmms-eval with the hippo model) on the bundled task hippo_narrate and the shipped pair.

The end-to-end run needs lmms-eval (`pip install 'hippo[eval]'`; .ci/run installs it) and is skipped
only when it cannot be imported. The oracle for the answers is not `--baseline`'s own comparison
alone: a logged answer is checked against transformers' `generate` on the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hippo.cli.main import main
from hippo.cli.pair.narration import step_token_score
from hippo.eval import narrate


def test_committed_documents_are_the_generators() -> None:
    lines = narrate.DOCS_FILE.read_text().splitlines()
    assert len(lines) == narrate.DOCUMENTS
    for i in (0, 1, 2, narrate.DOCUMENTS - 1):
        assert json.loads(lines[i]) == narrate.document(i)


def test_clip_is_rendered_once_and_read_back_exactly(tmp_path, monkeypatch) -> None:
    from hippo.cli.pair.narration import NARRATE_BENCH, narration_sample
    from hippo.media.inputs import decode_video

    monkeypatch.setenv("HIPPO_EVAL_CACHE", str(tmp_path))
    doc = narrate.document(1)
    (visual,) = narrate.doc_to_visual(doc)
    path = Path(visual["video"])
    assert path.parent == tmp_path / narrate.TASK and visual["nframes"] == NARRATE_BENCH.frames
    stamp = path.stat().st_mtime_ns
    assert narrate.clip_path(doc) == path and path.stat().st_mtime_ns == stamp  # cached, not rewritten
    clip = decode_video(path, frames=visual["nframes"])
    video = narration_sample(doc["seed"], NARRATE_BENCH).video
    expected = (
        video if video.dtype == torch.uint8 else (video.float().clamp(0, 1) * 255).round().to(torch.uint8)
    )
    assert torch.equal(clip.frames, expected) and clip.fps == doc["fps"]


def test_scoring_is_narrate_evals() -> None:
    doc = narrate.document(0)
    assert narrate.process_results(doc, [doc["answer"]]) == {
        "step_token_accuracy": step_token_score(doc["answer"], doc["answer"])
    }
    assert narrate.pooled_accuracy([(3, 4), (1, 4)]) == 0.5 and narrate.pooled_accuracy([]) == 0.0


def test_command_refuses_what_it_sets(capsys) -> None:
    pytest.importorskip("lmms_eval")
    assert main(["eval", "--tasks", "hippo_narrate", "--model_args", "target=x"]) == 2
    assert "--model_args is set by hippo eval" in capsys.readouterr().err
    assert main(["eval", "--tasks", "hippo_narrate", "--draft", "/d"]) == 2
    assert "--draft needs --target" in capsys.readouterr().err


def test_generation_kwargs_are_mapped_as_lmms_evals_qwen2_5_vl() -> None:
    pytest.importorskip("lmms_eval")
    from hippo.errors import UnsupportedError
    from hippo.eval.model import MAX_NEW_TOKENS, Hippo

    class Tok:
        eos_token_id = 7

        def decode(self, ids):
            return "<eos>"

    model = Hippo.__new__(Hippo)
    model.tokenizer = Tok()
    gen, until = model._generation({}, "t")
    assert gen == {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False} and until == ["<eos>"]
    gen, until = model._generation(
        {"max_new_tokens": 16, "temperature": 0, "top_p": 1.0, "until": ["\n\n"]}, "t"
    )
    assert gen == {"max_new_tokens": 16, "do_sample": False} and until == []
    gen, until = model._generation({"temperature": 0.7, "top_p": 0.9, "until": "Q:"}, "t")
    assert gen == {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": True, "temperature": 0.7, "top_p": 0.9}
    assert until == ["Q:"]
    with pytest.raises(UnsupportedError, match="num_beams"):
        model._generation({"num_beams": 4}, "t")
    with pytest.raises(UnsupportedError, match="log-likelihood"):
        model.loglikelihood([])


def test_the_lmms_eval_registry_finds_the_hippo_model() -> None:
    pytest.importorskip("lmms_eval")
    from lmms_eval.models import get_model

    from hippo.eval.model import Hippo

    assert get_model("hippo") is Hippo


def test_hippo_eval_baseline_on_the_shipped_pair(tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("lmms_eval")
    monkeypatch.setenv("HIPPO_EVAL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = ["eval", "--tasks", "hippo_narrate", "--limit", "2", "--baseline", "--output", str(out)]
    assert main([*argv, "--verbosity", "WARNING"]) == 0
    text = capsys.readouterr().out
    assert "answers identical to the target alone's: yes, all 2" in text and "metrics equal: yes" in text

    report = json.loads((out / "hippo_eval.json").read_text())
    assert report["identical"] is True and report["samples"] == 2 and report["differing"] == []
    assert report["metric"]["hippo"] == report["metric"]["baseline"]
    assert report["metrics"]["hippo"] == report["metrics"]["baseline"]
    assert report["speedup"] > 0 and report["mat"] >= 1.0

    # the logged samples: each answer with its speed, scored as narrate_eval scores it
    (samples,) = out.glob("*_samples_hippo_narrate.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [r["doc_id"] for r in rows] == [0, 1]
    docs = [narrate.document(i) for i in (0, 1)]
    texts = [
        r["filtered_resps"] if isinstance(r["filtered_resps"], str) else r["filtered_resps"][0] for r in rows
    ]
    scores = [step_token_score(t, d["answer"]) for t, d in zip(texts, docs)]
    pooled = sum(s[0] for s in scores) / sum(s[1] for s in scores)
    assert report["metric"]["hippo"] == pytest.approx(pooled)
    for r in rows:
        (counts,) = r["token_counts"]
        assert counts["new_tokens"] == counts["output_tokens"] > 0 and counts["mat"] >= 1.0
        assert counts["tokens_per_second"] > 0 and counts["ttft_s"] > 0 and counts["do_sample"] is False
    assert list((out / "baseline").glob("*_samples_hippo_narrate.jsonl"))

    # the oracle: the target's own greedy answer (transformers' generate) to the second document
    from hippo.builder import PipelineBuilder
    from hippo.eval.model import shipped_pair
    from hippo.media.inputs import load_tokenizer

    target, _, directory = shipped_pair()
    tokenizer = load_tokenizer(directory / "target")
    pipe = PipelineBuilder().target(target, backbone="qwen2_5_vl").scheduler("autoregressive").build()
    (visual,) = narrate.doc_to_visual(docs[1])
    inputs = pipe.video_inputs(
        visual["video"], docs[1]["question"], tokenizer=tokenizer, frames=visual["nframes"]
    )
    with torch.inference_mode():
        ref = target.generate(**inputs, max_new_tokens=400, do_sample=False)
    L = inputs["input_ids"].shape[-1]
    expected = tokenizer.decode(ref[0, L:], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert texts[1] == expected
