"""Throughput at batch 1, 2, 4: HF `generate` (batched, left-padded), hippo's batched target alone,
hippo's batched serial speculative decoding (fixed γ), `pearl` and `hippo` batched (their draft drafting each row's
next block on a thread beside the target, or in a draft process) and the default pipeline batched (`auto`:
serial with γ re-chosen each round for the whole batch, or the target alone), side by side in one
run, on the narration pair; each repeat times every method once, in an order rotated by one each
repeat, so the machine's drift falls on all of them alike. `auto` is reported against the fixed
configurations on the same pruning parts (the builder's default uniform 10%, and holistic top-10%).

    python -m hippo.benchmarks.throughput                       # 64 new tokens per row, 3 repeats
    python -m hippo.benchmarks.throughput --batches 1 2 4 8 --max-new-tokens 128

Each cell is the median over repeats of (new tokens of the batch) / (wall seconds of the whole call:
vision encoding, prefills, decoding), after one untimed warm-up call per method of a few tokens per row (it
allocates, packs the weights, and lets `auto` measure its costs: one row's once per machine, t_verify
of each batch size once per pipeline; with `--natural`, sizes first seen when rows finish early are
measured in a timed call); in brackets the decode phase:
(new tokens - one per row) / (that median - the median of the same call with max_new_tokens=1). Rows are fixed-length (`min_new_tokens` = `max_new_tokens`:
EOS is suppressed, as serving benchmarks do) unless `--natural`, so every method decodes the same
number of tokens per row. The prompts are the bench's narration clips (`bench.narrate_workload`),
batch b taking the first b clips. Each hippo row is checked against the same row decoded alone by
HF `generate` (float32: a near-tie may flip a token; the count of differing rows is printed). hippo is
given the same left-padded batch as HF `generate` and cuts it into rows (`hippo.padded`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import hippo
from hippo.padded import pad_rows

from .projection import batch_decode_projection
from .tables import markdown_table

#: hippo rows: (name, scheduler, scheduler options, pruning parts; None: the builder's defaults, a
#: uniform 10% of the video)
HIPPO_ROWS: list[tuple[str, str, dict, dict | None]] = [
    ("hippo batched, target alone", "autoregressive", {}, {}),
    ("hippo batched, default pipeline (auto)", "auto", {}, None),
    ("hippo batched serial SD, default parts", "serial", {"gamma": 5}, None),
    (
        "hippo batched auto, holistic top-k",
        "auto",
        {},
        {"scorer": "holistic", "selector": "topk", "selector_options": {"keep_ratio": 0.1}},
    ),
    (
        "hippo batched pearl, draft on a thread, default parts",
        "pearl",
        {"gamma": 5, "executor": "inline", "executor_options": {"overlap": "thread"}},
        None,
    ),
    (
        "hippo batched hippo, draft on a thread, default parts",
        "hippo",
        {"gamma": 5, "executor": "inline", "executor_options": {"overlap": "thread"}},
        None,
    ),
    (  # one thread per model, p's prefills on both (what `auto` picks on 4+ cores, halved)
        "hippo batched hippo, draft in a process, default parts",
        "hippo",
        {"gamma": 5, "executor": "process", "executor_options": {"threads": 1, "prefill_threads": 2}},
        None,
    ),
    ("hippo batched serial SD, full video", "serial", {"gamma": 5}, {}),
    (
        "hippo batched serial SD, holistic top-k",
        "serial",
        {"gamma": 5},
        {"scorer": "holistic", "selector": "topk", "selector_options": {"keep_ratio": 0.1}},
    ),
]

#: `auto` against the fixed configurations on the same pruning parts: (auto's row, the fixed rows)
AUTO_VERSUS_FIXED: list[tuple[str, list[str]]] = [
    ("hippo batched, default pipeline (auto)", ["hippo batched serial SD, default parts"]),
    ("hippo batched auto, holistic top-k", ["hippo batched serial SD, holistic top-k"]),
]


def run(batches: list[int], max_new_tokens: int, repeats: int, threads: int, natural: bool) -> dict:
    from hippo.benchmarks.bench import narrate_workload
    from hippo.cli.pair.narration import NARRATE_BENCH

    torch.set_num_threads(threads)
    w = narrate_workload(max(batches), 0, NARRATE_BENCH.frames, NARRATE_BENCH.size)
    gen = {"do_sample": False, "max_new_tokens": max_new_tokens}
    if not natural:
        gen["min_new_tokens"] = max_new_tokens
    pad_id = w.target.generation_config.pad_token_id
    if pad_id is None:
        eos = w.target.generation_config.eos_token_id
        pad_id = eos[0] if isinstance(eos, list) else eos
    with torch.inference_mode():  # each row alone: what every batched row must equal
        alone = [w.target.generate(**x, **gen)[0, x["input_ids"].shape[1] :].tolist() for x in w.inputs]
    first = {**gen, "max_new_tokens": 1, "min_new_tokens": 0}  # to the first token: vision + prefill
    warm = {**gen, "max_new_tokens": min(4, max_new_tokens)}
    if not natural:
        warm["min_new_tokens"] = warm["max_new_tokens"]
    table: dict[str, dict[int, dict]] = {}

    for b in batches:
        xs = w.inputs[:b]
        padded = pad_rows(xs, "left", pad_id)  # as the processor pads them
        calls = {"HF generate, batched (left-padded)": _hf(w.target, padded, pad_id)}
        pipes, last = [], {}
        scheduler_of = {name: scheduler for name, scheduler, _, _ in HIPPO_ROWS}
        for name, scheduler, options, parts in HIPPO_ROWS:
            builder = hippo.PipelineBuilder().target(w.target)
            if scheduler != "autoregressive":
                builder.draft(w.draft)
            if scheduler != "autoregressive" and parts is not None:
                builder.scorer(parts.get("scorer")).selector(
                    parts.get("selector", "full"), **parts.get("selector_options", {})
                )
            pipes.append(builder.scheduler(scheduler, **options).build())
            calls[name] = _ours(pipes[-1], xs, padded, gen, last.setdefault(name, []))
        for call in calls.values():
            call(warm)  # untimed warm-up (allocator, packed weights, auto's costs)
        rows, times = _alternated(calls, gen, repeats)
        _, firsts = _alternated(calls, first, repeats)
        for name in calls:
            tokens = sum(len(r) for r in rows[name])
            differ = sum(r != a for r, a in zip(rows[name], alone[:b]))
            med, med1 = statistics.median(times[name]), statistics.median(firsts[name])
            decode = (tokens - b) / (med - med1) if med > med1 else float("nan")
            table.setdefault(name, {})[b] = {
                "tokens": tokens,
                "seconds": times[name],
                "seconds_first": firsts[name],
                "tok_s": tokens / med,
                "decode_tok_s": decode,
                "differ": differ,
            }
            print(f"  {name:42s} batch {b}: {tokens / med:7.1f} tok/s, decode {decode:7.1f} tok/s ({tokens} tokens, "
                  f"{med:.2f} s, first token {med1:.2f} s; {differ} rows differ from generate alone)", flush=True)  # fmt: skip
            if last.get(name) and "auto" in name:  # what auto chose in its last timed call
                print(f"    {_plan_summary(last[name])}", flush=True)
            if last.get(name):  # its last timed call's rounds, charged at the paper's costs
                parallel = last[name][0].stats.plan.get("schedule", scheduler_of[name]) in ("pearl", "hippo")
                table[name][b]["projected"] = batch_decode_projection(last[name], parallel)
        for pipe in pipes:
            pipe.close()
    return table


def _alternated(
    calls: dict[str, Callable[[dict], list[list[int]]]], g: dict, repeats: int
) -> tuple[dict[str, list[list[int]]], dict[str, list[float]]]:
    """Each repeat times every call once on settings `g`, starting one call later each repeat:
    (each call's last rows, its seconds per repeat)."""
    names = list(calls)
    rows: dict[str, list[list[int]]] = {}
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            rows[name] = calls[name](g)
            times[name].append(time.perf_counter() - t0)
    return rows, times


def _hf(target: Any, padded: dict, pad_id: int) -> Callable[[dict], list[list[int]]]:
    L = padded["input_ids"].shape[1]

    def hf(g: dict) -> list[list[int]]:
        with torch.inference_mode():
            out = target.generate(**padded, **g, pad_token_id=pad_id)
        return [s[: _length(s, target, g["max_new_tokens"])] for s in out[:, L:].tolist()]

    return hf


def _ours(pipe: Any, xs: list, padded: dict, gen: dict, last: list) -> Callable[[dict], list[list[int]]]:
    def ours(g: dict) -> list[list[int]]:
        outs = pipe.generate_batch(padded, **g)  # the same padded batch as HF's, cut into rows
        if g is gen:
            last[:] = outs
        return [o.sequences[0, x["input_ids"].shape[1] :].tolist() for o, x in zip(outs, xs)]

    return ours


def auto_versus_fixed(table: dict, batches: list[int]) -> list[str]:
    """`auto`'s tokens/s over the best fixed configuration's on the same pruning parts, per batch size."""
    lines = []
    for auto, fixed in AUTO_VERSUS_FIXED:
        if auto not in table or not all(f in table for f in fixed):
            continue
        ratios = []
        for b in batches:
            best = max(table[f][b]["tok_s"] for f in fixed)
            ratios.append(f"{table[auto][b]['tok_s'] / best:.2f}")
        lines.append(
            f"{auto} / best of {', '.join(fixed)}: {' / '.join(ratios)} at batch {' / '.join(map(str, batches))}"
        )
    return lines


def _plan_summary(outs: list) -> str:
    """What `auto` chose for a batch: the schedule, the drafting rounds and γ's, the target-only steps."""
    s = outs[0].stats
    gammas = sorted({g for o in outs for g in o.stats.drafted_per_round})
    rounds = [o.stats.rounds for o in outs]
    steps = [o.stats.target_steps for o in outs]
    return f"auto chose {s.plan.get('schedule')}: rounds per row {rounds}, γ drafted {gammas}, target-only steps {steps}"


def _length(seq: list[int], model: Any, max_new: int) -> int:
    """New tokens of a padded batch row: up to and including its first EOS (the rest is padding)."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for i, t in enumerate(seq[:max_new]):
        if t in eos:
            return i + 1
    return min(len(seq), max_new)


def markdown(table: dict, batches: list[int]) -> str:
    """Tokens/s of the whole call, and of the decode phase (after the first token), per batch size."""
    header = ["method", *(f"batch {b} tok/s (decode)" for b in batches)]
    rows = [
        [name, *(f"{cells[b]['tok_s']:.1f} ({cells[b]['decode_tok_s']:.1f})" for b in batches)]
        for name, cells in table.items()
    ]
    return "\n".join(markdown_table(header, rows))


def projected(table: dict, batches: list[int]) -> str:
    """The hippo rows' decode phase projected to the paper's hardware (`projection.batch_decode_projection`):
    tokens/s and the speedup over the target alone on the same rows, over the range of Table 2's N."""
    header = ["method (projection, decode phase)", *(f"batch {b} tok/s (× target alone)" for b in batches)]
    rows = []
    for name, cells in table.items():
        if not all("projected" in cells.get(b, {}) for b in batches):
            continue
        row = [name]
        for b in batches:
            p = cells[b]["projected"]
            (r0, r1), (s0, s1) = p["tok_s"], p["speedup_over_target_alone"]
            row.append(f"{r0:.1f}-{r1:.1f} ({s0:.2f}-{s1:.2f}×)")
        rows.append(row)
    return "\n".join(markdown_table(header, rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--natural", action="store_true", help="stop at EOS (rows of different lengths)")
    ap.add_argument("--json", help="write the table (with the projections) to this file")
    args = ap.parse_args(argv)
    table = run(args.batches, args.max_new_tokens, args.repeats, args.threads, args.natural)
    print()
    print(markdown(table, args.batches))
    for line in auto_versus_fixed(table, args.batches):
        print(line)
    print("\nA projection to the paper's hardware (72B/7B, Table 2's forward costs; not a measurement):")
    print(projected(table, args.batches))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1, default=str)


if __name__ == "__main__":
    main()
