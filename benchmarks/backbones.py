"""Per-backbone figures: visual tokens per frame, pruning time, and MAT with and without pruning.

    python -m hippo.benchmarks.backbones [--frames 8] [--new 32] [--json FILE]

Each backbone's tiny random target drafts for itself (self-speculation) from the full video and from
10% of it (holistic + top-k), so MAT measures how much the pruned input changes the model's own
predictions; a separately trained draft exists only for Qwen2.5-VL (see `hippo bench`). For
LLaVA-OneVision both draft position schemes are compared (`original` keeps the gaps, `compact`
renumbers).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import hippo
from hippo.cli.video_commands import write_json
from hippo.registry import lookup

SIZES = {
    "qwen2_5_vl": (112, 112),
    "qwen3_vl": (128, 128),
    "llava_onevision": (112, 112),
    "video_salmonn2_plus": (112, 112),
}


def run_backbone(name: str, frames: int, new: int, videos: int) -> list[dict]:
    cls = lookup("adapters", name)
    target = cls.tiny_model("target", seed=0, dtype=torch.float32)
    h, w = SIZES[name]
    g = torch.Generator().manual_seed(0)
    inputs = [
        cls.synthetic_inputs(target, torch.rand(frames, h, w, 3, generator=g), [1, 17, 42], [61, 19, 77])
        for _ in range(videos)
    ]
    variants = [("full video", {}, 1.0), ("holistic top-10%", {}, 0.1)]
    if name == "llava_onevision":
        variants = [
            ("full video", {}, 1.0),
            ("top-10%, original positions", {"positions": "original"}, 0.1),
            ("top-10%, compact positions", {"positions": "compact"}, 0.1),
        ]
    rows = []
    for label, options, ratio in variants:
        pipe = (
            hippo.PipelineBuilder()
            .target(target)
            .draft(target, adapter_options=options)
            .scorer("holistic")
            .selector("topk", keep_ratio=ratio)
            .scheduler("serial", gamma=5)
            .build()
        )
        stats = [pipe.generate(x, max_new_tokens=new, do_sample=False).stats for x in inputs]
        s0 = stats[0]
        rows.append(
            {
                "backbone": name,
                "draft input": label,
                "visual tokens": s0.visual_tokens,
                "per frame": s0.visual_tokens // max(1, frames // (2 if name != "llava_onevision" else 1)),
                "kept": s0.kept_visual_tokens,
                "pruning ms": 1e3 * statistics.median(s.seconds_pruning for s in stats),
                "pruning share": statistics.median(s.seconds_pruning / s.seconds_total for s in stats),
                "MAT": statistics.median(s.mat for s in stats),
            }
        )
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--videos", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: tiny models only lose to more)"
    )
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in sorted(hippo.registry.registry("adapters")):
        rows += run_backbone(name, args.frames, args.new, args.videos)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    if args.json:
        write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
