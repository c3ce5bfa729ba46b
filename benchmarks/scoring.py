"""Time and peak extra memory of the token scorers at 16K-256K visual tokens.

    python benchmarks/scoring.py --quick                 # small sizes, a minute
    python benchmarks/scoring.py --json scoring.json     # 16K/64K/256K tokens at d=1024, 64K at d=3584

Inputs are random embeddings shaped as frames of 16x16 tokens (24x24 at d=3584), in float32 on CPU.
Scorers: temporal, spatial (tile and window crops, M=5), holistic without attention (temporal +
spatial + per-frame z-fusion), and the attention kernel for ONE decoder layer with realistic
shapes (28 query heads, 4 key/value heads, head dim 128, 32 text queries, keys = N visual + 64 text;
a full model multiplies its time by its layer count; memory does not grow with layers because
layers run one after another).

Memory: tracemalloc does not see torch's C++ allocations, so every case runs in a fresh subprocess
and the peak extra memory is the process's peak RSS (getrusage ru_maxrss, exact, kernel-tracked)
minus its RSS just before scoring, after the inputs exist and a small warm-up ran. Inputs are made
with empty().normal_() so nothing transient precedes scoring (the report flags it if something did).
The ratio column divides that by the bytes of the [N, D] embeddings (for the attention kernel too,
though its own input is the layer's keys, [4, L, 128]).

Goals (from the design brief): per-token time at 256K within 1.2x of 16K; peak extra < 2x embeddings.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

FULL = [(16384, 1024, 16), (65536, 1024, 16), (262144, 1024, 16), (65536, 3584, 24)]
QUICK = [(4096, 512, 16), (16384, 512, 16)]
SCORERS = ["temporal", "spatial", "spatial-window", "holistic-vision", "attention-layer"]
ATTENTION = dict(heads=28, kv_heads=4, head_dim=128, queries=32, text_keys=64)


# ---- one case, in its own process ----------------------------------------------------------


def _visual(n: int, d: int, side: int, dtype):
    import torch

    from hippo.types import VisualTokens

    t = max(1, n // (side * side))
    n = t * side * side
    embeds = torch.empty(n, d, dtype=dtype).normal_()
    return VisualTokens(embeds=embeds, seq_index=torch.arange(n), grids=((t, side, side),))


def _runner(scorer: str, n: int, d: int, side: int, dtype):
    """(callable running the scorer once, number of visual tokens, bytes of the embeddings)."""
    import torch

    if scorer == "attention-layer":
        from hippo.plugins.attention import text_to_visual_attention

        a = ATTENTION
        t = max(1, n // (side * side))
        n = t * side * side
        L = n + a["text_keys"]
        q = (
            torch.empty(a["heads"], a["queries"], a["head_dim"], dtype=dtype)
            .normal_()
            .mul_(a["head_dim"] ** -0.5)
        )
        k = torch.empty(a["kv_heads"], L, a["head_dim"], dtype=dtype).normal_()
        rows = torch.arange(L - a["queries"], L)
        cols = torch.arange(16, 16 + n)
        return (lambda: text_to_visual_attention(q, k, rows, cols, chunk=4096)), n, n * d * q.element_size()

    from hippo.plugins.scorers import HolisticScorer, SpatialScorer, TemporalScorer

    visual = _visual(n, d, side, dtype)
    part = {
        "temporal": TemporalScorer(),
        "spatial": SpatialScorer(),
        "spatial-window": SpatialScorer.from_options(crop_mode="window"),
        "holistic-vision": HolisticScorer.from_options(components=["temporal", "spatial"]),
    }[scorer]
    nbytes = visual.embeds.numel() * visual.embeds.element_size()
    return (lambda: part.score(visual, None)), visual.n, nbytes


def worker(spec: dict) -> dict:
    import psutil
    import torch

    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    warm, _, _ = _runner(spec["scorer"], 2 * spec["side"] ** 2, 64, spec["side"], dtype)
    warm()
    run, n, nbytes = _runner(spec["scorer"], spec["n"], spec["d"], spec["side"], dtype)
    gc.collect()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    times = []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    extra = max(0, peak - rss0)
    return {
        "scorer": spec["scorer"],
        "n": n,
        "d": spec["d"],
        "frame": f"{spec['side']}x{spec['side']}",
        "seconds": min(times),
        "seconds_all": times,
        "ns_per_token": 1e9 * min(times) / n,
        "peak_extra_bytes": extra,
        "embeddings_bytes": nbytes,
        "extra_vs_embeddings": extra / nbytes,
        "rss_before_bytes": rss0,
        "peak_masked": peak0 > rss0 + extra,  # an earlier transient could hide the scorer's peak
        "threads": spec["threads"],
        "dtype": spec["dtype"],
    }


# ---- driver ---------------------------------------------------------------------------------


def run_case(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {**spec, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ratios(results: list[dict]) -> list[dict]:
    """Per-token time of the largest N over the smallest N, per scorer and d."""
    out = []
    for scorer in sorted({r["scorer"] for r in results if "error" not in r}):
        for d in sorted({r["d"] for r in results if r.get("scorer") == scorer and "error" not in r}):
            rows = sorted(
                (r for r in results if r.get("scorer") == scorer and r["d"] == d and "error" not in r),
                key=lambda r: r["n"],
            )
            if len(rows) >= 2:
                lo, hi = rows[0], rows[-1]
                out.append(
                    {
                        "scorer": scorer,
                        "d": d,
                        "n_small": lo["n"],
                        "n_large": hi["n"],
                        "per_token_ratio": hi["ns_per_token"] / lo["ns_per_token"],
                    }
                )
    return out


def table(results: list[dict], scale: list[dict]) -> str:
    from .tables import markdown_table  # the workers run this file as a script

    header = ["scorer", "N", "d", "frame", "seconds", "ns/token", "peak extra MiB", "extra / embeddings"]
    lines = markdown_table(header, map(_result_row, results), align="lrrlrrrr")
    scaling = [
        [s["scorer"], s["d"], f"{s['per_token_ratio']:.2f}x ({s['n_large']} vs {s['n_small']})",
         "<= 1.2x: " + ("ok" if s["per_token_ratio"] <= 1.2 else "over")]
        for s in scale
    ]  # fmt: skip
    header = ["scorer", "d", "per-token time, N large / N small", "goal"]
    return "\n".join([*lines, "", *markdown_table(header, scaling, align="lr")])


def _result_row(r: dict) -> list[object]:
    if "error" in r:
        return [r["scorer"], r["n"], r["d"], "", f"error: {r['error']}"]
    flag = " (masked)" if r["peak_masked"] else ""
    return [r["scorer"], r["n"], r["d"], r["frame"], f"{r['seconds']:.3f}", f"{r['ns_per_token']:.0f}",
            f"{r['peak_extra_bytes'] / 2**20:.1f}{flag}", f"{r['extra_vs_embeddings']:.2f}x"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes only (4K and 16K tokens, d=512)")
    ap.add_argument("--scorers", default=",".join(SCORERS), help=f"comma-separated subset of {SCORERS}")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per case; the minimum is reported")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: steady on shared CPUs)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--timeout", type=float, default=600, help="seconds per case")
    ap.add_argument("--json", default="benchmarks/results/scoring.json", help="where to write the results")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    scorers = [s.strip() for s in args.scorers.split(",") if s.strip()]
    unknown = set(scorers) - set(SCORERS)
    if unknown:
        ap.error(f"unknown scorer(s) {sorted(unknown)}; choose from {SCORERS}")
    sizes = QUICK if args.quick else FULL
    results = []
    for n, d, side in sizes:
        for scorer in scorers:
            spec = dict(
                scorer=scorer,
                n=n,
                d=d,
                side=side,
                repeats=args.repeats,
                threads=args.threads,
                dtype=args.dtype,
            )
            r = run_case(spec, args.timeout)
            results.append(r)
            print(
                f"  {scorer:16s} N={r['n']:7d} d={d:5d}: "
                + (
                    f"{r['seconds']:.3f} s, extra {r['peak_extra_bytes'] / 2**20:.0f} MiB"
                    if "error" not in r
                    else r["error"]
                ),
                file=sys.stderr,
                flush=True,
            )
    scale = ratios(results)
    print(table(results, scale))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        payload = {
            "quick": args.quick,
            "attention_shapes": ATTENTION,
            "results": results,
            "scaling": scale,
            "cpu_count": os.cpu_count(),
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
