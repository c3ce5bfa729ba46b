"""`hippo bench`: the paper's Table 1 in miniature, every method side by side in one run.

For each method and each video, the wall time of `repeats` runs is measured and the median kept;
the speedup of a method is HF `generate` (the target alone) over it, per video, then the median over
videos. Every method's output is compared token for token with HF `generate`'s: a method that is
not lossless is flagged in the table, never hidden.

CPU split (the paper splits GPUs the same way): the target-alone baselines and the serial methods
get all `--threads` cores; the parallel methods (`pearl`, `hippo`) run the draft in its own process
with one core per model, and the target's prefill on both. (Their default, `executor="auto"`, runs
them one after the other on 2 cores, where that measured faster: `hippo.plugins.auto_executor`.)
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import hippo
from hippo.registry import lookup

from .command import DEFAULT_OUT
from .report import FirstToken, environment, section
from .tables import markdown_table

# ---- methods ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """One row of the table: a HF baseline (`hf`) or a hippo pipeline spec."""

    name: str
    hf: str | None = None  # "generate" | "compiled" | "assisted" | "prompt_lookup"
    scheduler: str = "serial"
    scheduler_options: dict = field(default_factory=dict)
    scorer: str | None = None
    scorer_options: dict = field(default_factory=dict)
    selector: str = "full"
    selector_options: dict = field(default_factory=dict)
    drafter: str = "chain"
    parallel: bool = False  # one core per model
    group: str = "main"
    compile: tuple[str, ...] = ()  # roles on compiled static-cache sessions (PipelineBuilder.compile)
    pack: tuple[str, ...] | None = None  # roles with packed linear weights (None: hippo's default)
    untrained_draft: bool = False  # the draft's architecture with random weights: it is rarely right


def _keep(ratio: float) -> dict:
    return {"keep_ratio": ratio}


def methods(keep: float, gamma: int, *, quick: bool, compiled: bool = True) -> list[Method]:
    serial = {"gamma": gamma}
    par = {"gamma": gamma, "executor": "process", "executor_options": {"prefill_threads": 2}}
    holistic = {"scorer": "holistic", "selector": "topk", "selector_options": _keep(keep)}

    def hippo_row(name: str, group: str = "main", options: dict | None = None, **parts) -> Method:
        """A `hippo` row, one core per model; holistic top-k unless `parts` say otherwise."""
        return Method(
            name,
            scheduler="hippo",
            scheduler_options={**par, **(options or {})},
            parallel=True,
            group=group,
            **{**holistic, **parts},
        )

    rows = [
        Method("HF generate (target alone)", hf="generate"),
        *([Method("HF generate, static cache + torch.compile", hf="compiled")] if compiled else []),
        Method("HF assisted (full video)", hf="assisted"),
        Method("HF prompt lookup", hf="prompt_lookup"),
        Method("autoregressive", scheduler="autoregressive"),
        Method("SD (serial, full video)", scheduler_options=serial),
        Method(
            "SpecVLM pruning (serial)",
            scheduler_options=serial,
            scorer="attention",
            selector="specvlm",
            selector_options=_keep(keep),
        ),
        Method("PEARL-video", scheduler="pearl", scheduler_options=par, parallel=True, **holistic),
        hippo_row("HIPPO"),
        hippo_row("HIPPO, γ from the cost model", options={"gamma": "auto"}),
        Method("auto (the default: schedule and γ from the cost model)", scheduler="auto", **holistic),
        Method("SD (serial, full video), γ from the cost model", scheduler_options={"gamma": "auto"}),
        Method(
            "SD (serial, full video), γ from the cost model, unpacked target",
            scheduler_options={"gamma": "auto"},
            pack=(),
        ),
        *(
            [
                hippo_row(
                    "HIPPO, γ from the cost model, compiled target",
                    options={"gamma": "auto"},
                    compile=("target",),
                ),
                Method(
                    "SD (serial, full video), γ from the cost model, compiled target",
                    scheduler_options={"gamma": "auto"},
                    compile=("target",),
                ),
            ]
            if compiled
            else []
        ),
        Method("SD-tree (full video)", scheduler="serial_tree", scheduler_options=serial, drafter="tree"),
        Method(
            "SpecVLM (tree + SpecVLM pruning)",
            scheduler="serial_tree",
            scheduler_options=serial,
            drafter="tree",
            scorer="attention",
            selector="specvlm",
            selector_options=_keep(keep),
        ),
        Method(
            "HIPPO + tree (serial)",
            scheduler="serial_tree",
            scheduler_options=serial,
            drafter="tree",
            **holistic,
        ),
    ]
    # low agreement: an untrained draft (the trained one's architecture, random weights) is rarely
    # right; the planner should then decode with the target alone (compare with `autoregressive`)
    rows += [
        Method(
            "low agreement: SD (serial), γ = 5, untrained draft",
            scheduler_options=serial,
            untrained_draft=True,
        ),
        Method(
            "low agreement: SD (serial), γ from the cost model, untrained draft",
            scheduler_options={"gamma": "auto"},
            untrained_draft=True,
        ),
        Method("low agreement: auto, untrained draft", scheduler="auto", untrained_draft=True, **holistic),
    ]
    if quick:
        return rows
    components = ("attention", "temporal", "spatial")
    for drop in components:
        kept = [c for c in components if c != drop]
        rows.append(hippo_row(f"HIPPO w/o {drop}", "ablation", scorer_options={"components": kept}))
    rows.append(Method("HIPPO w/o VPSD (serial)", scheduler_options=serial, group="ablation", **holistic))
    for sel in ("random", "frame", "fastvid", "dycoke"):
        rows.append(hippo_row(f"HIPPO-{sel}", "single-model", scorer=None, selector=sel))
    for ratio in (0.5, 0.25, 0.1, 0.05):
        rows.append(hippo_row(f"HIPPO keep {ratio:g}", "sweep-keep", selector_options=_keep(ratio)))
    for prune in ("late", "early"):  # two_phase is HIPPO's default (the main row)
        rows.append(hippo_row(f"HIPPO prune={prune}", "prune-mode", {"prune": prune}))
    # one core per model throughout, the target's prefill included
    rows.append(hippo_row("HIPPO, target prefill on 1 core", "cores", {"executor_options": {}}))
    rows.append(hippo_row("HIPPO auto_gamma (speed ratio)", "sweep-gamma", {"auto_gamma": True}))
    for g in (g for g in (2, 3, 5, 8, 12) if g != gamma):  # γ = gamma is the main HIPPO row
        rows.append(hippo_row(f"HIPPO γ={g}", "sweep-gamma", {"gamma": g}))
    return rows


# ---- workloads ----------------------------------------------------------------------------------


@dataclass
class Workload:
    target: Any
    draft: Any
    inputs: list[dict]
    decode: Callable[[list[int]], str] | None
    description: str


def tiny_workload(n: int, seed: int) -> Workload:
    """Random tiny Qwen2.5-VL pair (acceptance is chance: for smoke runs only)."""
    cls = lookup("adapters", "qwen2_5_vl")
    target, draft = cls.tiny_model("target", seed=seed), cls.tiny_model("draft", seed=seed + 1)
    g = torch.Generator().manual_seed(seed)
    inputs = [
        cls.synthetic_inputs(target, torch.rand(8, 112, 112, 3, generator=g), [1, 17, 42], [61, 19])
        for _ in range(n)
    ]
    return Workload(target, draft, inputs, None, "tiny random Qwen2.5-VL pair (smoke test only)")


def position_bias_chart(w: Workload, keep: float, out: Path) -> dict:
    """Attention-only vs holistic top-k on the first video (paper Figs. 2, 8): JSON figures + PNG."""
    from hippo.cli.bias import plot_position_bias, position_bias

    pipe = hippo.PipelineBuilder().target(w.target).scheduler("autoregressive").build()
    try:
        result = position_bias(pipe, w.inputs[0], keep_ratio=keep)
    finally:
        pipe.close()
    plot_position_bias(result, out / "position_bias.png")
    return {
        "base_rate": result["base_rate"],
        **{f"{name}_boundary_share": m["boundary_share"] for name, m in result["methods"].items()},
    }


def host_reads(w: Workload, keep: float, gamma: int, batches: tuple[int, ...] = (1, 8)) -> dict:
    """Host reads (GPU syncs on a device) per round outside the models' forwards, serial γ greedy:
    the extra reads of a 40-token answer over a 10-token one, per extra engine round, at each batch
    size (`hippo.syncs.HostReads`; the videos repeated to fill a batch). Not timed."""
    from hippo.engine import Engine
    from hippo.syncs import HostReads

    pipe = (
        hippo.PipelineBuilder().target(w.target).draft(w.draft).scorer("holistic")
        .selector("topk", keep_ratio=keep).scheduler("serial", gamma=gamma).build()
    )  # fmt: skip
    rounds, step = [0], Engine.step

    def counted(engine):
        rounds[0] += 1
        return step(engine)

    out: dict = {"schedule": f"serial, γ = {gamma}, greedy"}
    Engine.step = counted
    try:
        for B in batches:
            inputs = [w.inputs[i % len(w.inputs)] for i in range(B)]
            seen = []
            for n in (4, 10, 40):  # the first warms up
                rounds[0] = 0
                with HostReads() as reads:
                    if B == 1:
                        pipe.generate(inputs[0], max_new_tokens=n, do_sample=False)
                    else:
                        pipe.generate_batch(inputs, max_new_tokens=n, do_sample=False)
                seen.append((reads.count, rounds[0]))
            (c0, r0), (c1, r1) = seen[1:]
            out[f"batch {B}"] = round((c1 - c0) / max(r1 - r0, 1), 1)
    finally:
        Engine.step = step
        pipe.close()
    return out


def narrate_workload(n: int, seed: int, frames: int, size: int) -> Workload:
    """The committed narration pair on held-out clips; odd-numbered videos ask about one object.

    Even videos ask `narrate the video .` (2-3 objects: answers of 170-350 tokens, the paper's
    256-token regime); odd ones `narrate the <colour> object .`, naming one of the clip's objects,
    so what the answer needs from the video depends on the question.
    """
    from hippo.cli.pair.checkpoint import CHECKSUMS, NARRATE_DIR, load_pair
    from hippo.cli.pair.narration import NARRATE_BENCH, narration_config, narration_sample
    from hippo.cli.pair.task import COLOURS

    from .tokenizer import processor_inputs

    if not (NARRATE_DIR / CHECKSUMS).is_file():
        raise hippo.errors.ModelError(
            f"the narration pair is not in {NARRATE_DIR} yet; train it with `python -m hippo.benchmarks.narrate_train` "
            "or run `hippo bench --pair tiny` for a smoke test"
        )
    target, draft, tok = load_pair(directory=NARRATE_DIR)
    cfg = narration_config(size, frames, min_objects=NARRATE_BENCH.min_objects)
    inputs = []
    for i in range(n):
        s = 10**9 + seed + i
        objects = narration_sample(s, cfg, ask=("all", None)).objects
        ask = ("all", None) if i % 2 == 0 else ("colour", COLOURS[objects[i // 2 % len(objects)].colour])
        clip = narration_sample(s, cfg, ask=ask)
        inputs.append(processor_inputs(tok, clip.video, clip.question, fps=clip.fps))
    desc = (
        f"narration pair, {n} held-out clips of {frames} frames at {size}px ({cfg.visual_tokens} visual tokens), "
        "questions alternating 'narrate the video .' / 'narrate the <colour> object .'"
    )
    return Workload(target, draft, inputs, lambda ids: tok.decode(ids, skip_special_tokens=True), desc)


def trained_workload(n: int, seed: int, frames: int, size: int) -> Workload:
    """The committed captioning pair on held-out synthetic captioning videos (short answers)."""
    from hippo.cli.pair.checkpoint import CHECKSUMS, load_pair
    from hippo.cli.pair.task import TaskConfig, sample

    from .pair import PAIR_DIR
    from .tokenizer import processor_inputs

    if not (PAIR_DIR / CHECKSUMS).is_file():
        raise hippo.errors.ModelError(
            f"the trained pair is not in {PAIR_DIR} yet; train it with `python -m hippo.benchmarks.train` "
            "or run `hippo bench --pair tiny` for a smoke test"
        )
    target, draft, tok = load_pair(directory=PAIR_DIR)
    cfg = TaskConfig(frames=frames, size=size)
    held_out = 10**9 + seed
    inputs = [processor_inputs(tok, sample(held_out + i, cfg).video) for i in range(n)]
    desc = f"trained pair, {n} held-out videos of {frames} frames at {size}px ({cfg.visual_tokens} visual tokens)"
    return Workload(target, draft, inputs, lambda ids: tok.decode(ids, skip_special_tokens=True), desc)


# ---- running ------------------------------------------------------------------------------------


def _untrained(model: torch.nn.Module) -> torch.nn.Module:
    """The same architecture and dtype with freshly initialised weights (seed 0)."""
    torch.manual_seed(0)
    return type(model)(model.config).to(next(model.parameters()).dtype).eval()


def _pipeline(m: Method, w: Workload) -> hippo.Pipeline:
    b = hippo.PipelineBuilder().target(w.target).draft(_untrained(w.draft) if m.untrained_draft else w.draft)
    b.scorer(m.scorer, **m.scorer_options).selector(m.selector, **m.selector_options).drafter(m.drafter)
    if m.compile:
        b.compile(*m.compile)
    if m.pack is not None:
        b.pack(*m.pack)
    return b.scheduler(m.scheduler, **m.scheduler_options).build()


def _compiled() -> dict:
    """HF generate's own static cache + torch.compile path, forced on for CPU (it compiles only on GPUs
    by default): inductor without CUDA graphs, as a CPU user would pick it."""
    from transformers import CompileConfig

    cc = CompileConfig(mode="default", fullgraph=False)
    cc._compile_all_devices = True  # transformers' switch for compiling on CPU
    return {"cache_implementation": "static", "compile_config": cc}


def _hf_call(m: Method, w: Workload, inputs: dict, gen: dict) -> Callable[[], tuple[torch.Tensor, dict]]:
    extra = {
        "assisted": {"assistant_model": w.draft},
        "prompt_lookup": {"prompt_lookup_num_tokens": 5},
        "compiled": _compiled() if m.hf == "compiled" else {},
    }
    kwargs = {**gen, **extra.get(m.hf, {})}

    def call():
        first = FirstToken()
        out = w.target.generate(**inputs, **kwargs, streamer=first)
        return out, {"seconds_ttft": first.seconds}

    return call


def _hippo_call(pipe: hippo.Pipeline, inputs: dict, gen: dict) -> Callable[[], tuple[torch.Tensor, dict]]:
    def call():
        out = pipe.generate(inputs, **gen)
        return out.sequences, out.stats.as_dict()

    return call


def _timed(call: Callable, repeats: int) -> tuple[torch.Tensor, dict, list[float]]:
    """The last run's output and stats, each run's seconds; `seconds_ttft` is the median over the
    runs, each at most its own run's time, so the median is at most the median run's."""
    times, ttft, out, stats = [], [], None, {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, stats = call()
        times.append(time.perf_counter() - t0)
        ttft.append(stats.get("seconds_ttft", 0.0))
    return out, {**stats, "seconds_ttft": statistics.median(ttft)}, times


def _project(m: Method, w: Workload, per_video: list[dict], gen: dict) -> list[float] | None:
    """Each video's virtual seconds on the paper's hardware (`projection.py`); None where the row
    has no projection (tree drafting, HF's own loops other than plain generate)."""
    from .projection import autoregressive_seconds, paper_curve, serial_seconds, simulated_options

    if m.hf == "generate" or m.scheduler == "autoregressive":
        return [autoregressive_seconds(v["new_tokens"]) for v in per_video]
    if m.hf is not None or m.drafter != "chain":
        return None
    if not m.parallel:
        return [serial_seconds(v["stats"]) for v in per_video]
    sim = Method(**{**m.__dict__, "scheduler_options": simulated_options(m.scheduler_options)})
    pipe = _pipeline(sim, w)
    if pipe.scheduler.auto is not None:  # γ from the cost model: on the paper's costs, not this CPU's
        pipe.scheduler.auto.curve = paper_curve()
    try:
        seconds = []
        for inputs in w.inputs:
            pipe.generate(inputs, **gen)
            seconds.append(pipe.scheduler.executor.clock.now)  # the simulated executor's virtual clock
        return seconds
    finally:
        pipe.close()


def run(
    workload: Workload,
    rows: list[Method],
    *,
    max_new_tokens: int,
    repeats: int,
    threads: int,
    gamma: int,
    keep_ratio: float = 0.1,
    min_new_tokens: int = 0,
    project: bool = True,
    timeline: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Every row on every video; `timeline`: draw the `hippo` row's run on the first video there
    (one extra, untimed run with the event record on)."""
    from .regime import measure_costs

    gen = {"max_new_tokens": max_new_tokens, "do_sample": False}
    if min_new_tokens:  # fixed-length runs: EOS is suppressed until then (as serving benchmarks do)
        gen["min_new_tokens"] = min_new_tokens
    results: dict[str, dict] = {}
    references: list[torch.Tensor] = []
    torch.set_num_threads(threads)
    w = workload
    compiled = any(m.compile for m in rows)
    costs = measure_costs(
        w.target, w.draft, w.inputs[0], gamma, keep_ratio, threads=threads, compiled=compiled
    )
    drawn = False
    for m in rows:
        pipe = None
        try:
            if m.hf is None:
                pipe = _pipeline(m, w)
            per_video = []
            for i, inputs in enumerate(w.inputs):
                call = _hf_call(m, w, inputs, gen) if m.hf else _hippo_call(pipe, inputs, gen)
                if i == 0 or m.hf == "compiled":  # warm-up (starts a draft process; compiles per shape)
                    t0 = time.perf_counter()
                    compile_s = call()[1].get("seconds_compile", 0.0)
                    if m.hf == "compiled" or compile_s:
                        log(f"    compile + first run, video {i}: {time.perf_counter() - t0:.1f}s")
                seq, stats, times = _timed(call, repeats)
                if m.hf == "generate" and len(references) <= i:
                    references.append(seq)
                identical = bool(torch.equal(seq.cpu(), references[i].cpu()))
                per_video.append(
                    {
                        "seconds": statistics.median(times),
                        "times": times,
                        "identical": identical,
                        "new_tokens": int(seq.shape[1] - inputs["input_ids"].shape[1]),
                        "stats": stats,
                    }
                )
            results[m.name] = {"method": m.__dict__, "videos": per_video}
            if timeline is not None and m.scheduler == "hippo" and pipe is not None and not drawn:
                drawn = True  # the first hippo row (the HIPPO headline row)
                from hippo.cli.timeline import draw_timeline

                events = pipe.generate(w.inputs[0], timeline=True, **gen).stats
                results[m.name]["timeline"] = str(
                    draw_timeline(events, timeline, title=f"hippo bench: {m.name}")
                )
                log(f"    timeline of the hippo row, video 0: {timeline}")
            if (
                project and m.group == "main" and not m.untrained_draft
            ):  # projected on the trained pair's costs
                results[m.name]["projected"] = _project(m, w, per_video, gen)
            log(f"  {m.name}: {statistics.median(v['seconds'] for v in per_video):.3f}s/video")
        except Exception as exc:  # a baseline that cannot run is reported, not fatal
            results[m.name] = {"method": m.__dict__, "error": f"{type(exc).__name__}: {exc}"}
            log(f"  {m.name}: FAILED ({exc})")
        finally:
            if pipe is not None:
                pipe.close()
    return summarise(results, costs, gamma)


def _decode_seconds(video: dict) -> float:
    """Wall seconds after the target's prefill: the part of a run that speculative decoding speeds up.

    hippo runs report the target's vision + prefill time; for HF rows the time to the first token
    stands in for it (vision, prefill and one LM head). Not the hippo TTFT: HIPPO's first token
    comes after its buffered drafts are verified, which would hide decoding work in the prefill.
    """
    st = video["stats"]
    return video["seconds"] - (st.get("seconds_target_prefill") or st.get("seconds_ttft", 0.0))


def summarise(results: dict, costs: dict, gamma: int) -> dict:
    from .projection import autoregressive_seconds
    from .regime import regime

    base = results.get("HF generate (target alone)")
    base_secs = [v["seconds"] for v in base["videos"]] if base and "videos" in base else None
    base_decode = [_decode_seconds(v) for v in base["videos"]] if base_secs else None
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append({"name": name, "group": r["method"]["group"], "error": r["error"]})
            continue
        vids = r["videos"]
        secs = [v["seconds"] for v in vids]
        speed = [b / s for b, s in zip(base_secs, secs)] if base_secs else [float("nan")]
        decode_speed = (
            [b / d for b, d in zip(base_decode, (_decode_seconds(v) for v in vids)) if d > 0]
            if base_decode
            else []
        )
        st = [v["stats"] for v in vids if "mat" in v["stats"]]  # hippo runs (HF rows: TTFT only)
        mat = statistics.median(s["mat"] for s in st) if st else 1.0
        mat_paper = statistics.median(s["mat_accumulated"] for s in st) if st else 1.0

        def med(key: str, st: list = st) -> float:
            return statistics.median(s[key] for s in st) if st else 0.0

        bound = (
            mat * costs["t_decode"] / costs["t_verify"]
            if st and r["method"]["scheduler"] != "autoregressive"
            else 1.0
        )
        row = {
            "name": name,
            "group": r["method"]["group"],
            "identical": all(v["identical"] for v in vids),
            "seconds": statistics.median(secs),
            "speedup": statistics.median(speed),
            "decode_speedup": statistics.median(decode_speed) if decode_speed else float("nan"),
            "mat": mat,
            "mat_paper": mat_paper,
            "tokens_per_second": statistics.median(v["new_tokens"] / v["seconds"] for v in vids),
            "ttft": statistics.median(v["stats"].get("seconds_ttft", 0.0) for v in vids),
            "prefill_share": statistics.median(
                v["stats"].get("seconds_ttft", 0.0) / v["seconds"] for v in vids if v["seconds"] > 0
            ),
            "target_prefill": med("seconds_target_prefill"),
            "target_decode": med("seconds_target_decode"),
            "draft_prefill": med("seconds_draft_prefill"),
            "draft_decode": med("seconds_draft_decode"),
            "pruning": med("seconds_pruning"),
            "pruning_share": statistics.median(s["seconds_pruning"] / s["seconds_total"] for s in st)
            if st
            else 0.0,
            "draft_hidden": med("draft_hidden_fraction"),
            "mat_bound": bound,
            # the bound limits the decoding phase, so it is compared with the decode speedup
            "bound_achieved": statistics.median(decode_speed) / bound
            if bound > 0 and decode_speed
            else float("nan"),
            "fallback": any(s.get("fallback") for s in st),
        }
        projected = r.get("projected")
        if projected:
            ar = [autoregressive_seconds(v["new_tokens"]) for v in vids]
            row["projected_seconds"] = statistics.median(projected)
            row["projected_speedup"] = statistics.median(a / p for a, p in zip(ar, projected))
        rows.append(row)
    raw = {name: r.get("videos", r.get("error")) for name, r in results.items()}
    hf = next((r for r in rows if r["name"] == "HF generate (target alone)" and "error" not in r), None)
    return {
        "rows": rows,
        "costs": costs,
        "gamma": gamma,
        "regime": regime(costs, hf["prefill_share"] if hf else None),
        "per_video": raw,
    }


# ---- reporting ----------------------------------------------------------------------------------


def _headline(rows: list[dict]) -> list[str]:
    """Like the paper's Table 1: MAT, the paper's MAT, end-to-end and decode-phase speedups."""
    header = ["method", "lossless", "MAT", "MAT (paper)", "e2e speedup", "decode-phase speedup"]
    return markdown_table([*header, "projected on the paper's hardware"], map(_headline_row, rows))


def _headline_row(r: dict) -> list[str]:
    if "error" in r:
        return [r["name"], f"n/a: {r['error'][:100]}"]
    flag = "yes" if r["identical"] else "**NO**"
    proj = f"{r['projected_speedup']:.2f}x" if "projected_speedup" in r else ""
    mats = [f"{r['mat']:.2f}", f"{r['mat_paper']:.2f}"]
    return [r["name"], flag, *mats, f"{r['speedup']:.2f}x", f"{r['decode_speedup']:.2f}x", proj]


def _details(rows: list[dict]) -> list[str]:
    head = (
        "| method | tok/s | TTFT s (share) | target prefill / decode s | draft prefill / decode s | "
        "pruning ms (share) | draft hidden | MAT bound (achieved) |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        if "error" in r:
            continue
        lines.append(
            f"| {r['name']} | {r['tokens_per_second']:.1f} | {r['ttft']:.3f} ({r['prefill_share']:.0%}) | "
            f"{r['target_prefill']:.3f} / {r['target_decode']:.3f} | {r['draft_prefill']:.3f} / "
            f"{r['draft_decode']:.3f} | {r['pruning'] * 1e3:.1f} ({r['pruning_share']:.2%}) | "
            f"{r['draft_hidden']:.0%} | {r['mat_bound']:.2f} ({r['bound_achieved']:.0%}) |"
        )
    return lines


def _breakdown(rows: list[dict]) -> list[str]:
    """Like the paper's Table 2: where the seconds of the target-alone run and of HIPPO go."""
    from .regime import PAPER

    by = {r["name"]: r for r in rows if "error" not in r}
    ar, hp = by.get("autoregressive"), by.get("HIPPO")
    if ar is None or hp is None:
        return []
    hidden = f" (overlapped {hp['draft_hidden']:.0%})"

    def cell(x: float, tag: str = "") -> str:
        return f"{x:.3f}{tag}"

    return [
        "| operation (s, median per video) | autoregressive | HIPPO | paper: vanilla | paper: HIPPO |",
        "|---|---|---|---|---|",
        f"| target prefill (vision + LM) | {cell(ar['target_prefill'])} | {cell(hp['target_prefill'])} | "
        f"{PAPER['target_prefill']} | {PAPER['target_prefill']} |",
        f"| target decoding | {cell(ar['target_decode'])} | {cell(hp['target_decode'])} | "
        f"{PAPER['target_decode_ar']} | {PAPER['target_decode_hippo']} |",
        f"| draft prefill | - | {cell(hp['draft_prefill'], hidden)} | - | {PAPER['draft_prefill']} (overlapped) |",
        f"| draft decoding | - | {cell(hp['draft_decode'], hidden)} | - | {PAPER['draft_decode']} (overlapped) |",
        f"| video token pruning | - | {cell(hp['pruning'])} | - | {PAPER['pruning']} (overlapped) |",
        f"| total | {cell(ar['seconds'])} | {cell(hp['seconds'])} | {PAPER['total_ar']} | {PAPER['total_hippo']} |",
    ]


def markdown(summary: dict) -> str:
    from .projection import COSTS
    from .regime import PAPER_SPEEDUP, regime_markdown

    rows, c = summary["rows"], summary["costs"]
    lines = ["### Speed and acceptance (paper Table 1)", "", *_headline(rows), ""]
    lines.append(
        "MAT: tokens per target verification. MAT (paper): tokens accumulated over consecutive rounds until "
        "a rejection (HIPPO Sec. 6.1). e2e speedup: HF generate's wall time over the method's, per video, "
        "median. Decode-phase speedup: the same after the target's prefill (vision + LM prefill; HF rows: "
        f"after the first token). Projected: this run's acceptance replayed with the paper's per-forward "
        f"costs (`benchmarks/projection.py`: target prefill {COSTS['target_prefill']} s, target forward "
        f"{COSTS['target_forward']:.3f} s, draft prefill {COSTS['draft_prefill']} s, draft forward "
        f"{COSTS['draft_forward']:.3f} s); the paper reports {PAPER_SPEEDUP:.2f}x for HIPPO. A projection, "
        "not a measurement."
    )
    breakdown = _breakdown(rows)
    if breakdown:
        lines += ["", "### Time breakdown (paper Table 2)", "", *breakdown]
    lines += ["", "### Regime", "", regime_markdown(summary["regime"], c, summary["gamma"]), ""]
    lines += ["### Details", "", *_details(rows), ""]
    reads = summary.get("host_reads")
    if reads:
        per = ", ".join(f"{k}: {v}" for k, v in reads.items() if k != "schedule")
        lines += [
            f"Host reads per round outside the models' forwards ({reads['schedule']}; each is a sync on a "
            f"GPU): {per}.",
            "",
        ]
    lines.append(
        f"Target cost: {c['t_decode'] * 1e3:.2f} ms per decode step, {c['t_verify'] * 1e3:.2f} ms per "
        f"{summary['gamma'] + 1}-token verification; draft {c['t_draft_full'] * 1e3:.2f} ms per step "
        f"({c['t_draft_pruned'] * 1e3:.2f} ms pruned). MAT bound = MAT x t_decode / t_verify(γ+1)."
    )
    return "\n".join(lines)


def plots(summary: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if "error" not in r]
    paths = []
    fig, ax = plt.subplots(figsize=(8, max(3, 0.35 * len(rows))))
    ax.barh(
        [r["name"] for r in rows],
        [r["speedup"] for r in rows],
        color=["tab:green" if r["identical"] else "tab:red" for r in rows],
    )
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("speedup over HF generate (median)")
    ax.invert_yaxis()
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    sweep = [r for r in rows if r["group"] == "sweep-keep"]
    if sweep:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ratios = [1 - float(r["name"].split()[-1]) for r in sweep]
        ax.plot([x * 100 for x in ratios], [r["mat"] for r in sweep], "o-")
        ax.set_xlabel("visual tokens pruned (%)")
        ax.set_ylabel("MAT")
        fig.tight_layout()
        paths.append(out / "mat_vs_pruning.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def results_markdown(summary: dict) -> str:
    """The whole report as one Markdown document: the machine, CPU, versions and date, then the tables."""
    env, s = summary["environment"], summary["settings"]
    gen = summary["generation"]
    length = (
        f"{gen['min_new_tokens']}-{gen['max_new_tokens']}"
        if gen["min_new_tokens"]
        else f"up to {gen['max_new_tokens']}"
    )
    run = (
        f"`hippo bench{' --quick' if s['quick'] else ''} --pair {s['pair']}`: {s['videos']} videos x "
        f"{s['repeats']} repeats, {length} new tokens, keep ratio {s['keep_ratio']}, γ = {s['gamma']}"
        f"{'' if s['compiled'] else ', no compiled rows'}, seed {env['seed']}"
    )
    return "\n".join(
        [
            "# hippo bench results",
            "",
            f"Written by `hippo bench` on {env['date']}. Medians over repeats, measured on the machine below; "
            "another CPU gives other timings and other speedups.",
            "",
            "| | |",
            "|---|---|",
            f"| run | {run} |",
            f"| workload | {summary['workload']} |",
            f"| CPU | {env['cpu_model']}, {env['cpu_count']} logical CPUs; target-alone and serial rows on "
            f"{env['threads']} threads, `pearl`/`hippo` rows one thread per model while decoding |",
            f"| CPU flags | {' '.join(env['cpu_flags']) or 'n/a'}; torch's CPU kernels: {env['cpu_capability']} |",
            f"| system | {env['machine']} |",
            f"| versions | Python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, "
            f"hippo {env['hippo']} |",
            "",
            markdown(summary),
        ]
    )


def write_results(summary: dict, directory: Path, markdown_file: Path | None = None) -> list[Path]:
    """Write table.md (the Markdown report), results.json and the plots into `directory`, and the
    Markdown report to `markdown_file` as well when one is given. Returns the files written."""
    report = results_markdown(summary) + "\n"
    written = [directory / "table.md", directory / "results.json"]
    written[0].write_text(report)
    written[1].write_text(json.dumps(summary, indent=2, default=str))
    if markdown_file is not None:
        # a report file keeps its long-video section (`hippo bench --long --out FILE.md` writes it)
        kept = section(markdown_file.read_text()) if markdown_file.is_file() else ""
        markdown_file.write_text(report + (f"\n{kept}" if kept else ""))
        written.append(markdown_file)
    return written + plots(summary, directory)


def main(
    *,
    quick: bool = False,
    pair: str = "narrate",
    videos: int | None = None,
    repeats: int | None = None,
    max_new_tokens: int | None = None,
    min_new_tokens: int = 0,
    keep_ratio: float = 0.1,
    gamma: int = 5,
    frames: int | None = None,
    size: int | None = None,
    threads: int = 2,
    compiled: bool = True,
    seed: int = 0,
    out: str | os.PathLike = DEFAULT_OUT,
    timeline: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Run the bench and write its results. `out` is a directory (table.md, results.json, plots) or a
    `.md` file: then the Markdown report goes to that file and the rest to `DEFAULT_OUT`."""
    markdown_file = Path(out) if Path(out).suffix == ".md" else None
    out = Path(DEFAULT_OUT) if markdown_file else Path(out)
    out.mkdir(parents=True, exist_ok=True)
    videos = videos or (2 if quick else 4)
    repeats = repeats or (1 if quick else 2)
    if pair == "tiny":
        w = tiny_workload(videos, seed)
    elif pair == "caption":
        from hippo.cli.pair.task import BENCHMARK

        w = trained_workload(videos, seed, frames or BENCHMARK.frames, size or BENCHMARK.size)
    else:
        from hippo.cli.pair.narration import NARRATE_BENCH

        w = narrate_workload(videos, seed, frames or NARRATE_BENCH.frames, size or NARRATE_BENCH.size)
    if max_new_tokens is None:  # the paper's 256 on the narration pair; captions end far sooner
        max_new_tokens = 256 if pair == "narrate" else 48
    length = f"{min_new_tokens}-{max_new_tokens}" if min_new_tokens else f"up to {max_new_tokens}"
    log(f"hippo bench: {w.description}; {videos} videos x {repeats} repeats, {length} new tokens")
    rows = methods(keep_ratio, gamma, quick=quick, compiled=compiled)
    summary = run(
        w,
        rows,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        repeats=repeats,
        threads=threads,
        gamma=gamma,
        keep_ratio=keep_ratio,
        timeline=timeline,
        log=log,
    )
    summary["generation"] = {"max_new_tokens": max_new_tokens, "min_new_tokens": min_new_tokens}
    summary["settings"] = {
        "quick": quick,
        "pair": pair,
        "videos": videos,
        "repeats": repeats,
        "keep_ratio": keep_ratio,
        "gamma": gamma,
        "compiled": compiled,
    }
    summary["environment"] = environment(seed, threads)
    summary["workload"] = w.description
    summary["position_bias"] = position_bias_chart(w, keep_ratio, out)
    summary["host_reads"] = host_reads(w, keep_ratio, gamma)
    written = write_results(summary, out, markdown_file)
    summary["plots"] = [str(p) for p in written if p.suffix == ".png"] + [str(out / "position_bias.png")]
    log(markdown(summary))
    log(f"hippo bench: wrote {', '.join(str(p) for p in written if p.suffix != '.png')}")
    return summary
