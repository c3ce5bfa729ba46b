"""Cost and acceptance figures of the pair: decode ms/token, prefill seconds, and serial-SD MAT.

    python -m hippo.benchmarks.measure                      # benchmark setting (448 px, 16 frames), 5 repeats
    python -m hippo.benchmarks.measure --size 112 --frames 8 --videos 4 --repeats 3

Decode cost is timed through hippo's Qwen2.5-VL adapter (the code path the pipeline uses): prefill
once, then one token per forward call; the figure is the median over tokens and repeats. MAT comes
from `hippo.PipelineBuilder` with the serial scheduler (greedy), with the full video for the draft
and with uniform pruning; every output is checked against the target's own `generate`.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import hippo  # noqa: E402
from hippo.adapters.qwen2_5_vl import Qwen25VLAdapter  # noqa: E402
from hippo.benchmarks.models import n_params  # noqa: E402
from hippo.benchmarks.tokenizer import processor_inputs  # noqa: E402
from hippo.cli.pair.task import BENCHMARK, TaskConfig, sample  # noqa: E402

HELD_OUT = 10**9


@torch.inference_mode()
def decode_cost(
    model, inputs: dict, keep_ratio: float | None = None, tokens: int = 16, repeats: int = 5
) -> dict[str, float]:
    """Median ms of one decode forward (one token), and seconds of encoding and prefill, after a warm-up."""
    adapter = Qwen25VLAdapter(model)
    per_token, prefill, encode = [], [], []
    for r in range(repeats + 1):
        t_enc = time.perf_counter()
        enc = adapter.encode(inputs)
        t_enc = time.perf_counter() - t_enc
        keep = None
        if keep_ratio is not None:
            n = enc.visual.n
            k = max(1, round(keep_ratio * n))
            keep = ((torch.arange(k, dtype=torch.float64) + 0.5) * n / k).floor().long()
        t0 = time.perf_counter()
        session = adapter.prefill(enc, keep)
        t1 = time.perf_counter()
        tok = int(session.last_logits.argmax())
        times = []
        for _ in range(tokens):
            t = time.perf_counter()
            logits = session.forward(torch.tensor([tok]))
            times.append(time.perf_counter() - t)
            tok = int(logits[-1].argmax())
        if r:  # the first round warms up
            per_token.extend(times)
            prefill.append(t1 - t0)
            encode.append(t_enc)
    return {
        "ms_per_token": 1e3 * statistics.median(per_token),
        "vision_s": statistics.median(encode),  # vision encoder and positions (adapter.encode)
        "prefill_s": statistics.median(prefill),  # language-model prefill (kept tokens only when pruned)
    }


@torch.inference_mode()
def serial_mat(
    target, draft, tokenizer, cfg: TaskConfig, seeds, keep_ratio: float | None, gamma: int = 5
) -> dict:
    builder = hippo.PipelineBuilder().target(target).draft(draft).scheduler("serial", gamma=gamma)
    builder = (
        builder.selector("full") if keep_ratio is None else builder.selector("uniform", keep_ratio=keep_ratio)
    )
    pipe = builder.build()
    mats, lossless = [], True
    for s in seeds:
        inputs = processor_inputs(tokenizer, sample(s, cfg).video, dtype=target.dtype)
        out = pipe.generate(inputs, max_new_tokens=24, do_sample=False)
        ref = target.generate(**inputs, max_new_tokens=24, do_sample=False)
        lossless &= out.sequences.tolist() == ref.tolist()
        mats.append(out.stats.mat)
    return {"mat": statistics.fmean(mats), "per_video": [round(m, 3) for m in mats], "lossless": lossless}


def main(argv=None) -> None:
    from hippo.benchmarks.pair import PAIR_DIR
    from hippo.cli.pair.checkpoint import load_pair

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=BENCHMARK.size)
    p.add_argument("--frames", type=int, default=BENCHMARK.frames)
    p.add_argument("--videos", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-mat", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    wide, draft, tokenizer = load_pair(directory=PAIR_DIR)
    small, _, _ = load_pair(wide=False, directory=PAIR_DIR, verify=False)
    cfg = TaskConfig(size=args.size, frames=args.frames)
    inputs = processor_inputs(tokenizer, sample(HELD_OUT, cfg).video)
    report = {
        "setting": {"size": args.size, "frames": args.frames, "visual_tokens": cfg.visual_tokens},
        "threads": args.threads,
        "params": {"target": n_params(small), "target_wide": n_params(wide), "draft": n_params(draft)},
        "cost": {
            "target": decode_cost(small, inputs, repeats=args.repeats),
            "target_wide": decode_cost(wide, inputs, repeats=args.repeats),
            "draft": decode_cost(draft, inputs, repeats=args.repeats),
            "draft_keep0.1": decode_cost(draft, inputs, keep_ratio=0.1, repeats=args.repeats),
        },
    }
    c = report["cost"]
    report["ratio_wide_over_draft"] = c["target_wide"]["ms_per_token"] / c["draft"]["ms_per_token"]
    report["ratio_wide_over_draft_keep0.1"] = (
        c["target_wide"]["ms_per_token"] / c["draft_keep0.1"]["ms_per_token"]
    )
    report["ratio_small_over_draft"] = c["target"]["ms_per_token"] / c["draft"]["ms_per_token"]
    if not args.skip_mat:
        seeds = range(HELD_OUT, HELD_OUT + args.videos)
        report["mat_full"] = serial_mat(wide, draft, tokenizer, cfg, seeds, None)
        report["mat_uniform0.1"] = serial_mat(wide, draft, tokenizer, cfg, seeds, 0.1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
