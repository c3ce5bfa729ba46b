"""Four questions on one video: encode once (`Pipeline.prepare` / `ask`) vs re-encoding per question.

For each video, four questions (narrate everything, narrate one object, narrate another, where
does a shape go) are answered three ways, timed in total and per question, with each question's
time to first token:

- `HF generate per question`: `target.generate` on each whole prompt (the video re-encoded each time);
- `hippo, no reuse`: the HIPPO pipeline's `generate` on each whole prompt;
- `hippo, video context`: `prepare` once, then `ask` each question from the cached prefix
  (the first question's time and TTFT include `prepare`).

Every answer is compared with HF's, token for token. The goals (issue 15): later questions' TTFT
<= 10% of the first's, and the 4-question session >= 2x faster than hippo without reuse.

    python -m hippo.benchmarks.questions --quick         # tiny random pair: checks that it runs
    python -m hippo.benchmarks.questions                 # the committed narration pair
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import hippo


def narration_questions(
    n_videos: int, seed: int, frames: int, size: int
) -> tuple[Any, Any, list[list[dict]], str]:
    """(target, draft, per video the four questions' inputs, description) on the narration pair."""
    from hippo.cli.pair.checkpoint import NARRATE_DIR, load_pair
    from hippo.cli.pair.narration import NARRATE_BENCH, narration_config, narration_sample
    from hippo.cli.pair.task import COLOURS, SHAPES

    from .tokenizer import processor_inputs

    target, draft, tok = load_pair(directory=NARRATE_DIR)
    cfg = narration_config(size, frames, min_objects=max(2, NARRATE_BENCH.min_objects))
    videos = []
    for i in range(n_videos):
        s = 10**9 + seed + i
        objects = narration_sample(s, cfg, ask=("all", None)).objects
        asks = [
            ("all", None),
            ("colour", COLOURS[objects[0].colour]),
            ("colour", COLOURS[objects[1 % len(objects)].colour]),
            ("shape", SHAPES[objects[0].shape]),
        ]
        clips = [narration_sample(s, cfg, ask=a) for a in asks]
        videos.append([processor_inputs(tok, c.video, c.question, fps=c.fps) for c in clips])
    desc = f"narration pair, {n_videos} clip(s) of {frames} frames at {size}px, 4 questions each"
    return target, draft, videos, desc


def tiny_questions(n_videos: int, seed: int) -> tuple[Any, Any, list[list[dict]], str]:
    """A random tiny Qwen2.5-VL pair (acceptance is chance: a smoke run only)."""
    from hippo.registry import lookup

    cls = lookup("adapters", "qwen2_5_vl")
    target, draft = cls.tiny_model("target", seed=seed), cls.tiny_model("draft", seed=seed + 1)
    g = torch.Generator().manual_seed(seed)
    videos = []
    for _ in range(n_videos):
        video = torch.rand(8, 112, 112, 3, generator=g)
        videos.append([cls.synthetic_inputs(target, video, [1, 17, 42], [61, 19 + q, 23]) for q in range(4)])
    return target, draft, videos, "tiny random Qwen2.5-VL pair (smoke test only)"


def _pipeline(target: Any, draft: Any, keep: float, gamma: int | str) -> hippo.Pipeline:
    """HIPPO as the bench's rows build it (holistic top-k, `hippo` schedule, a draft process):
    γ from the cost model when `gamma` is "auto", else the main row at that γ."""
    from .bench import _pipeline as build
    from .bench import methods

    name = "HIPPO, γ from the cost model" if gamma == "auto" else "HIPPO"
    fixed = 5 if gamma == "auto" else int(gamma)
    row = next(m for m in methods(keep, fixed, quick=True, compiled=False) if m.name == name)
    return build(row, type("W", (), {"target": target, "draft": draft})())


def measure(
    target: Any,
    draft: Any,
    videos: list[list[dict]],
    *,
    max_new_tokens: int = 256,
    keep: float = 0.1,
    gamma: int | str = "auto",
    threads: int = 2,
) -> dict:
    """Per method: total seconds per video (median over videos), per-question seconds and TTFT
    (per position, median over videos), whether every answer equals HF's; plus memory per context."""
    gen = {"max_new_tokens": max_new_tokens, "do_sample": False}
    torch.set_num_threads(threads)
    rows: dict[str, list[dict]] = {
        "HF generate per question": [],
        "hippo, no reuse": [],
        "hippo, video context": [],
    }
    memory: list[dict] = []
    pipe = _pipeline(target, draft, keep, gamma)
    try:
        pipe.generate(videos[0][0], max_new_tokens=2)  # warm-up: starts the draft process
        for questions in videos:
            refs, hf = [], {"seconds": [], "ttft": []}
            for inputs in questions:
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    refs.append(target.generate(**inputs, **gen))
                    hf["seconds"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    target.generate(**inputs, **{**gen, "max_new_tokens": 1})
                    hf["ttft"].append(time.perf_counter() - t0)
            rows["HF generate per question"].append({**hf, "identical": True})
            plain = {"seconds": [], "ttft": [], "identical": True}
            for inputs, ref in zip(questions, refs):
                t0 = time.perf_counter()
                out = pipe.generate(inputs, **gen)
                plain["seconds"].append(time.perf_counter() - t0)
                plain["ttft"].append(out.stats.seconds_ttft)
                plain["identical"] &= bool(torch.equal(out.sequences, ref))
            rows["hippo, no reuse"].append(plain)
            reuse = {"seconds": [], "ttft": [], "identical": True}
            t0 = time.perf_counter()
            ctx = pipe.prepare(questions[0])
            prepare = time.perf_counter() - t0
            for i, (inputs, ref) in enumerate(zip(questions, refs)):
                ids = inputs["input_ids"][0]
                if not torch.equal(ids[: ctx.length], ctx.prefix_ids):
                    raise ValueError("the questions' prompts do not share the video prefix")
                t0 = time.perf_counter()
                out = pipe.ask(ctx, ids[ctx.length :], **gen)
                extra = prepare if i == 0 else 0.0
                reuse["seconds"].append(time.perf_counter() - t0 + extra)
                reuse["ttft"].append(out.stats.seconds_ttft + extra)
                reuse["identical"] &= bool(torch.equal(out.sequences, ref))
            reuse["prepare_seconds"] = prepare
            rows["hippo, video context"].append(reuse)
            memory.append(
                {**ctx.memory(), "prefix_tokens": ctx.length, "visual_tokens": ctx.encoded.visual.n}
            )
            ctx.close()
    finally:
        pipe.close()
    return summarise(rows, memory)


def summarise(rows: dict[str, list[dict]], memory: list[dict]) -> dict:
    out: dict[str, Any] = {"methods": {}, "memory_per_context": memory}
    for name, per_video in rows.items():
        n = len(per_video[0]["seconds"])
        out["methods"][name] = {
            "total_seconds": statistics.median(sum(v["seconds"]) for v in per_video),
            "per_question_seconds": [statistics.median(v["seconds"][i] for v in per_video) for i in range(n)],
            "ttft_seconds": [statistics.median(v["ttft"][i] for v in per_video) for i in range(n)],
            "identical": all(v["identical"] for v in per_video),
        }
    ctx, plain = out["methods"]["hippo, video context"], out["methods"]["hippo, no reuse"]
    later = max(ctx["ttft_seconds"][1:]) / ctx["ttft_seconds"][0]
    out["goals"] = {
        "later_ttft_over_first": later,
        "later_ttft_goal_met": later <= 0.10,
        "speedup_over_no_reuse": plain["total_seconds"] / ctx["total_seconds"],
        "speedup_goal_met": plain["total_seconds"] / ctx["total_seconds"] >= 2.0,
        "speedup_over_hf": out["methods"]["HF generate per question"]["total_seconds"] / ctx["total_seconds"],
    }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="tiny random pair, 8 new tokens: checks that it runs"
    )
    ap.add_argument("--videos", type=int, default=3)
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--size", type=int, default=168)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--keep", type=float, default=0.1)
    ap.add_argument("--gamma", default="auto", help='draft length γ, or "auto" (default: the cost model)')
    ap.add_argument("--threads", type=int, default=2, help="cores for HF generate and prepare (default: 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the result here")
    a = ap.parse_args(argv)
    if a.quick:
        target, draft, videos, desc = tiny_questions(1, a.seed)
        a.max_new_tokens = min(a.max_new_tokens, 8)
    else:
        target, draft, videos, desc = narration_questions(a.videos, a.seed, a.frames, a.size)
    result = measure(
        target, draft, videos, max_new_tokens=a.max_new_tokens, keep=a.keep, gamma=a.gamma, threads=a.threads
    )
    result["description"] = desc
    result["settings"] = {k: v for k, v in vars(a).items() if k != "json"}
    for name, m in result["methods"].items():
        per = ", ".join(f"{s:.2f}" for s in m["per_question_seconds"])
        ttft = ", ".join(f"{s:.3f}" for s in m["ttft_seconds"])
        print(
            f"{name:26s} total {m['total_seconds']:.2f}s  per question [{per}]  TTFT [{ttft}]  "
            f"identical={m['identical']}"
        )
    mem = result["memory_per_context"][0]
    print(
        f"memory per context: KV {mem['kv'] / 2**20:.1f} MiB, features {mem['features'] / 2**20:.1f} MiB, "
        f"draft features {mem['draft_features'] / 2**20:.1f} MiB ({mem['prefix_tokens']} prefix tokens)"
    )
    print("goals:", json.dumps(result["goals"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
