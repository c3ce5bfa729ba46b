"""The `hippo_narrate` task: the narration pair's held-out clips and reference narrations, offline.

Each document is one held-out clip of the narration task (`hippo.cli.pair.narration`, the clips
`hippo demo` renders: seeds from `HELD_OUT` on, never seen in training) and one question about it,
drawn from the clip's seed as the pair's evaluation draws it (`narration_sample`). The documents (seed,
question, reference answer) are committed in `tasks/hippo_narrate/hippo_narrate.jsonl`, written by
`write_documents`; the clips are rendered from their seeds the first time a document is read, as
lossless FFV1 files in a cache directory (`HIPPO_EVAL_CACHE`, default `~/.cache/hippo/eval`), so
the task needs no download. Answers are scored as `python -m hippo.benchmarks.narrate_eval` scores
them: `step_token_score` (words right, step by step, out of the reference's), pooled over the
documents.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hippo.cli.pair.narration import NARRATE_BENCH, narration_sample, step_token_score
from hippo.cli.pair.task import TEMPORAL
from hippo.eval import TASKS

#: clip seeds the pair never saw in training (as `hippo demo` and `narrate_eval` use them)
HELD_OUT = 10**9
#: documents in the committed task file
DOCUMENTS = 32
TASK = "hippo_narrate"
DOCS_FILE = TASKS / TASK / f"{TASK}.jsonl"


def document(index: int) -> dict[str, Any]:
    """The index-th held-out clip's document: its seed, the question and the reference answer."""
    seed = HELD_OUT + index
    smp = narration_sample(seed, NARRATE_BENCH)
    return {
        "id": index,
        "seed": seed,
        "question": smp.question,
        "answer": smp.caption,
        "frames": NARRATE_BENCH.frames,
        "fps": smp.fps,
    }


def write_documents(path: str | os.PathLike = DOCS_FILE, n: int = DOCUMENTS) -> Path:
    """Write the task's documents as JSON lines (what is committed; re-run after a task change)."""
    p = Path(path)
    p.write_text("".join(json.dumps(document(i)) + "\n" for i in range(n)))
    return p


def cache_dir() -> Path:
    return Path(os.environ.get("HIPPO_EVAL_CACHE") or Path.home() / ".cache" / "hippo" / "eval") / TASK


def clip_path(doc: dict[str, Any]) -> Path:
    """The document's clip as a video file, rendered from its seed on first use (lossless FFV1)."""
    from hippo.media.video import write_video

    cfg = NARRATE_BENCH
    path = cache_dir() / f"clip-{cfg.size}px-{cfg.frames}f-{doc['seed']}.mkv"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    smp = narration_sample(int(doc["seed"]), cfg)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # written whole, then moved in place
        part = write_video(Path(tmp) / path.name, smp.video, smp.fps)
        os.replace(part, path)
    return path


def doc_to_visual(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One video, with every frame of the clip (the pair was trained on 4 fps: one temporal patch per
    half second), in the qwen-vl-utils message form the `hippo` model reads."""
    return [{"type": "video", "video": str(clip_path(doc)), "nframes": int(doc["frames"])}]


def doc_to_text(doc: dict[str, Any], lmms_eval_specific_kwargs: dict | None = None) -> str:
    kw = lmms_eval_specific_kwargs or {}
    return f"{kw.get('pre_prompt', '')}{doc['question']}{kw.get('post_prompt', '')}"


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    right, total = step_token_score(results[0], doc["answer"])
    return {"step_token_accuracy": (right, total)}


def pooled_accuracy(items: list[tuple[int, int]]) -> float:
    """Words right over reference words, pooled over the documents (as narrate_eval reports it)."""
    total = sum(t for _, t in items)
    return sum(r for r, _ in items) / total if total else 0.0


assert NARRATE_BENCH.frames % TEMPORAL == 0
