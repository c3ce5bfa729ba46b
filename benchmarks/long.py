"""`hippo bench --long`: long videos, where HIPPO's pruning and parallel drafting are meant to pay.

The committed long-video pair (`benchmarks/pair_lists/`, trained by `python -m hippo.benchmarks.lists_train`)
answers four questions about needle-in-a-haystack clips (`hippo.cli.pair.lists`): 6 brief needles
in a drifting haystack with circling distractors, one attribute of each (colour, shape, row,
direction) listed in temporal order, one word per needle and a full stop. Both models are widened
function-preservingly at load time (`hippo.cli.pair.widen`), the key/value heads not copied, so that
the pair's costs are shaped like a 72B target's and a 7B draft's (`docs/long-video.md`): 8 query
heads per key/value head, the target's KV cache at 8k visual tokens under 10% of a decode step's
bytes, the draft ~1/10 of the target's weights; their outputs are the trained models'.

For each N (visual tokens) one held-out clip is answered by every row, warm (each pipeline ran once
on the smallest clip first), the rows one after another in one process, the target alone both first
and last: every speedup is over the mean of its two runs, so a machine whose speed drifts during the
rows favours no row for its place, and the report gives the drift (last over first) per N:

- `target_alone` (hippo's `autoregressive`) and `hf_generate` (transformers' `generate`);
- `serial` with each selector: `full`, `uniform`, `attention` (top-k of the target's prompt
  attention: SpecVLM/FastV-style), `holistic` (HIPPO), `sink_window` (StreamingLLM/MagicDec) and
  `oracle` (the needles' tokens, then uniform);
- `hippo` (parallel) with holistic; `self_spec` (the target drafts for itself on the pruned video);
  `auto` (the default) with holistic.

Two workloads: `one_question` (cold: the target's prefill and `what happens ?`, `generate`) and
`four_questions` (`prepare` once, then the four different questions of `lists.QUESTIONS` with `ask`;
the headline long-video workload, since on a CPU the prefill dominates one cold answer; HF
`generate` has no prepared video, so its four are four cold questions, left out of `--quick`).
Every output is compared with HF `generate`'s (in `--quick`, the four answers with the target
alone's, whose first answer is compared with HF `generate`'s). `auto` rows give the keep ratio
`auto` chose for each answer (`keep_ratio_used`), and every row a `projected_e2e`: its measured
rounds charged at the paper's hardware's costs scaled to its N (`projection.long_projection`; a
projection, with the range that Table 2's unknown N gives).
Per row: MAT, needle recall (the share of needle tokens the draft kept), the draft's cost per token
over the target's, TTFT and prefill share, end-to-end and decode-phase speedups over `target_alone`,
peak resident memory, and whether the output is identical. Per N: the target's decode step and its
(γ+1)-token verification against the bytes they must read (weights + KV) at the machine's measured
read bandwidth. `claims` puts the paper's claims beside what this run measured.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import hippo
from hippo.errors import ModelError

from .projection import long_projection
from .report import LONG_HEADING, section

SWEEP = (576, 2048, 4096, 8192, 16384)
QUICK_SWEEP = (576, 8192)
KEEP_RATIOS = (0.05, 0.1, 0.25)
QUICK_KEEP = (0.1,)
QUESTIONS = 4  # answers per prepared video in the `four_questions` workload
#: selector name in results -> (registered selector, scorer)
SELECTORS = {
    "full": ("full", None),
    "uniform": ("uniform", None),
    "attention": ("topk", "attention"),
    "holistic": ("topk", "holistic"),
    "sink_window": ("sink_window", None),
    "oracle": ("oracle", None),
}
MiB = 2**20


@dataclass(frozen=True)
class Row:
    method: str  # target_alone | hf_generate | serial | hippo | self_spec | auto
    selector: str = "full"
    keep_ratio: float = 1.0

    @property
    def name(self) -> str:
        if self.method in ("target_alone", "hf_generate"):
            return self.method
        keep = "" if self.selector == "full" else f" {self.keep_ratio:.0%}"
        return f"{self.method} {self.selector}{keep}"


def rows(keep_ratios: tuple[float, ...]) -> list[Row]:
    out = [Row("target_alone"), Row("hf_generate"), Row("serial", "full")]
    for r in keep_ratios:
        out += [Row("serial", s, r) for s in SELECTORS if s != "full"]
        out += [Row("hippo", "holistic", r), Row("self_spec", "holistic", r), Row("auto", "holistic", r)]
    return out


@dataclass
class Clip:
    tokens: int  # N visual tokens
    inputs: dict  # processor inputs of the whole prompt (the first question)
    needles: torch.Tensor  # [M] visual-token indices showing a needle
    needle_depth: torch.Tensor  # [M] the depth in [0, 1] of each such token's needle
    reference: str  # the task's own answer
    #: the four questions' texts, each one's processor inputs (the same video) and its token ids
    #: after the prompt's shared prefix (what `ask_ids` is given about a prepared video)
    questions: tuple[str, ...] = ()
    question_inputs: tuple[dict, ...] = ()
    question_ids: tuple[torch.Tensor, ...] = ()


def load_long_pair(dtype: torch.dtype = torch.float32) -> tuple[Any, Any, Any]:
    """(target, draft, tokenizer) of the long-video pair, both widened (same outputs)."""
    from hippo.cli.pair.checkpoint import CHECKSUMS, load_pair
    from hippo.cli.pair.widen import widen

    from .pair import DRAFT_WIDEN, LISTS_DIR

    if not (LISTS_DIR / CHECKSUMS).is_file():
        raise ModelError(
            f"the long-video pair is not in {LISTS_DIR}; train it with `python -m hippo.benchmarks.lists_train`"
        )
    target, draft, tok = load_pair(dtype, directory=LISTS_DIR)
    return target, widen(draft, **DRAFT_WIDEN[LISTS_DIR.name]).to(dtype), tok


def clip(tokenizer: Any, tokens: int, seed: int) -> Clip:
    from hippo.cli.pair.lists import MAIN, QUESTIONS, lists_sample
    from hippo.cli.pair.niah import FPS, config_for, needle_rows

    from .tokenizer import processor_inputs, prompt_ids

    smp = lists_sample(10**9 + seed, config_for(tokens), MAIN)
    rows_ = needle_rows(smp)
    depth = torch.tensor([n.depth for n in smp.needles])[smp.token_labels["step"][rows_] - 1]
    inputs = processor_inputs(tokenizer, smp.video, MAIN, fps=FPS)
    n = int(smp.token_labels["step"].numel())
    video = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    shared = int((inputs["input_ids"][0] == video).nonzero().max()) + 1  # up to the last video token
    per_question, after = [], []
    for q in QUESTIONS:
        ids = torch.tensor([prompt_ids(tokenizer, n, q)])
        assert torch.equal(ids[0, :shared], inputs["input_ids"][0, :shared])
        per_question.append(
            {
                **inputs,
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "mm_token_type_ids": (ids == video).long() * 2,
            }
        )
        after.append(ids[0, shared:])
    return Clip(n, inputs, rows_, depth, smp.caption, tuple(QUESTIONS), tuple(per_question), tuple(after))


def pipeline(row: Row, target: Any, draft: Any, clip_: Clip, gamma: int) -> hippo.Pipeline:
    selector, scorer = SELECTORS[row.selector]
    b = hippo.PipelineBuilder().target(target)
    b.draft(target if row.method == "self_spec" else draft)
    options = {} if selector == "full" else {"keep_ratio": row.keep_ratio}
    if selector == "oracle":
        options["keep"] = clip_.needles
    b.scorer(scorer).selector(selector, **options)
    scheduler = {"target_alone": "autoregressive", "self_spec": "serial"}.get(row.method, row.method)
    sched_options = {"gamma": gamma} if scheduler in ("serial", "hippo") else {}
    return b.scheduler(scheduler, **sched_options).build()


class PeakMemory:
    """The process's peak resident memory while the block runs (sampled every 5 ms from /proc), and
    `extra`: how far above its resident memory at the start (what the run itself held: caches,
    activations, features; the models are loaded before)."""

    @property
    def extra(self) -> int:
        return self.peak - self.start

    def __enter__(self) -> PeakMemory:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak so far instead
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second this process reads from memory (the median of summing a `mib` MiB tensor)."""
    x = torch.ones(mib * MiB // 4)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        float(x.sum())
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


def _recall(kept: torch.Tensor | None, c: Clip) -> tuple[float, dict[str, float]]:
    """(share of needle tokens kept, that share per needle depth)."""
    if kept is None:
        return 1.0, {}
    hit = torch.isin(c.needles, kept.cpu())
    by_depth: dict[str, list[bool]] = {}
    for d, h in zip(c.needle_depth.tolist(), hit.tolist()):
        by_depth.setdefault(f"{d:.2f}", []).append(h)
    return float(hit.float().mean()) if hit.numel() else 1.0, {
        d: sum(v) / len(v) for d, v in by_depth.items()
    }


def one_question(row: Row, pipe: hippo.Pipeline | None, target: Any, c: Clip, gen: dict) -> dict:
    """A cold question: the whole prompt's prefill and one answer."""
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        if pipe is None:  # HF generate
            from .report import FirstToken

            first = FirstToken()
            seq = target.generate(**c.inputs, **gen, streamer=first)
            seconds = time.perf_counter() - t0
            stats, kept, prefill = {"seconds_ttft": first.seconds}, None, first.seconds
        else:
            out = pipe.generate(c.inputs, **gen)
            seconds = time.perf_counter() - t0
            seq, stats, kept = out.sequences, out.stats.as_dict(), out.kept_visual_index
            prefill = stats["seconds_target_prefill"]
    return {
        "seq": seq[0, c.inputs["input_ids"].shape[1] :].tolist(),
        "seconds": seconds,
        "decode_seconds": seconds - prefill,
        "ttft": stats["seconds_ttft"],
        "stats": stats,
        "kept": kept,
        "peak": mem.peak,
        "extra": mem.extra,
    }


def four_questions(pipe: hippo.Pipeline | None, target: Any, c: Clip, gen: dict) -> dict:
    """One prepared video, its `QUESTIONS` different questions (HF generate: each whole prompt cold)."""
    if len(c.questions) != QUESTIONS:
        raise ValueError(
            f"a clip of the four-question workload has {QUESTIONS} questions, not {len(c.questions)}"
        )
    answers = []
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        if pipe is None:
            for inputs in c.question_inputs:
                seq = target.generate(**inputs, **gen)
                answers.append((seq[0, inputs["input_ids"].shape[1] :].tolist(), {}))
            prepare = 0.0
        else:
            ctx = pipe.prepare(c.inputs)
            prepare = time.perf_counter() - t0
            try:
                for inputs, question in zip(c.question_inputs, c.question_ids, strict=True):
                    out = pipe.ask_ids(ctx, question, **gen)
                    answers.append(
                        (out.sequences[0, inputs["input_ids"].shape[1] :].tolist(), out.stats.as_dict())
                    )
            finally:
                ctx.close()
        seconds = time.perf_counter() - t0
    asks = [s for _, s in answers if s]
    return {
        "seqs": [a for a, _ in answers],
        "asks": asks,
        "seconds": seconds,
        "prepare_seconds": prepare,
        "decode_seconds": seconds - prepare - sum(s["seconds_target_prefill"] for s in asks),
        "mat": statistics.fmean(s["mat"] for s in asks) if asks else 1.0,
        "peak": mem.peak,
        "extra": mem.extra,
    }


def step_costs(target: Any, draft: Any, c: Clip, gamma: int, bandwidth: float) -> dict:
    """The target's decode step and (γ+1)-token verification at this N, against their bytes bound:
    the language model's weights plus the KV cache, read once per forward at `bandwidth`."""
    from hippo.registry import lookup

    from .regime import lm_weight_bytes, measure_costs

    costs = measure_costs(target, draft, c.inputs, gamma, 0.1, threads=torch.get_num_threads(), repeats=5)
    t0 = time.perf_counter()
    lookup("adapters", "qwen2_5_vl")(draft).encode(c.inputs)  # the draft's vision tower on every frame
    draft_vision = time.perf_counter() - t0
    cfg = target.config.text_config
    kv_per_token = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    )
    kv = kv_per_token * next(target.parameters()).element_size() * c.inputs["input_ids"].shape[1]
    bound = (lm_weight_bytes(target) + kv) / bandwidth
    return {
        "t_decode": costs["t_decode"],
        "t_verify": costs["t_verify"],
        "t_target_prefill": costs["t_target_prefill"],
        "t_draft_full": costs["t_draft_full"],
        "t_draft_pruned_10": costs["t_draft_pruned"],
        "t_draft_vision": draft_vision,
        "kv_bytes": kv,
        "bytes_bound_s": bound,
        "decode_over_bound": costs["t_decode"] / bound,
        "verify_over_bound": costs["t_verify"] / bound,
    }


def run(
    *,
    quick: bool = False,
    sweep: tuple[int, ...] | None = None,
    keep_ratios: tuple[float, ...] | None = None,
    gamma: int = 5,
    max_new_tokens: int = 96,
    threads: int = 2,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    torch.set_num_threads(threads)
    sweep = sweep or (QUICK_SWEEP if quick else SWEEP)
    keep_ratios = keep_ratios or (QUICK_KEEP if quick else KEEP_RATIOS)
    target, draft, tok = load_long_pair()
    gen = {"max_new_tokens": max_new_tokens, "do_sample": False}
    bandwidth = read_bandwidth()
    log(
        f"long bench: N = {list(sweep)}, keep ratios {list(keep_ratios)}, read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    table = rows(keep_ratios)
    clips = {n: clip(tok, n, seed) for n in sweep}
    warm = clips[min(sweep)]
    pipes: dict[str, hippo.Pipeline | None] = {}
    for row in table:  # built once and warmed on the smallest clip (packing, draft processes)
        pipes[row.name] = None if row.method == "hf_generate" else pipeline(row, target, draft, warm, gamma)
    out_rows, per_n = [], {}
    try:
        for i, n in enumerate(sweep):
            c = clips[n]
            t_n = time.perf_counter()
            log(f"N = {c.tokens} visual tokens ({c.needles.numel()} needle tokens)")
            per_n[c.tokens] = step_costs(target, draft, c, gamma, bandwidth)
            results: dict[str, Any] = {}
            # the target alone first and again last (each speedup is over the mean of the two), the
            # other rows between, their order reversed at every other N (`row_order`)
            for row in row_order(table, i):
                pipe = pipes[row.name]
                if pipe is not None and row.selector == "oracle":  # the oracle knows this clip's needles
                    pipe.close()
                    pipe = pipes[row.name] = pipeline(row, target, draft, c, gamma)
                again = row.name in results
                if (n == min(sweep) and not again) or row.selector == "oracle":  # warm-up
                    one_question(row, pipe, target, c, {**gen, "max_new_tokens": 4})
                # HF generate has no prepared video: its four questions are four cold ones (left out
                # of --quick, where they would take 1.5 min at 8k)
                skip_four = quick and row.method == "hf_generate"
                measured = (
                    one_question(row, pipe, target, c, gen),
                    None if skip_four else four_questions(pipe, target, c, gen),
                )
                one = measured[0]
                log(
                    f"  {row.name}{' (again)' if again else ''}: {one['seconds']:.2f}s, MAT {one['stats'].get('mat', 1.0):.2f}"
                )
                if not again:
                    results[row.name] = measured
                    continue
                results[row.name], drift = bracket(results[row.name], measured)
                per_n[c.tokens]["target_alone_drift"] = drift
                log(
                    f"  the target alone, last over first: {drift[0]:.3f} / {drift[1]:.3f} (one / four questions); N done in {time.perf_counter() - t_n:.0f} s"
                )
            out_rows += _rows_at(c, table, results, per_n[c.tokens])
    finally:
        for pipe in pipes.values():
            if pipe is not None:
                pipe.close()
    summary = {
        "rows": out_rows,
        "steps": per_n,
        "bandwidth_bytes_per_s": bandwidth,
        "gamma": gamma,
        "questions": list(clips[min(sweep)].questions),
    }
    summary["claims"] = claims(summary, target, tok, clips[max(sweep)], log)
    return summary


def row_order(table: list[Row], i: int) -> list[Row]:
    """The rows' order at the i-th N: the target alone first and again last, the others between, in
    the table's order at even i and reversed at odd i, so that no row always runs late in an N (a
    machine that drifts during the rows favours no row by its place)."""
    baseline = Row("target_alone")
    if table[0] != baseline:
        raise ValueError("the long bench's table starts with the target alone")
    rest = table[1:] if i % 2 == 0 else table[:0:-1]
    return [baseline, *rest, baseline]


def bracket(
    first: tuple[dict, dict], last: tuple[dict, dict]
) -> tuple[tuple[dict, dict], tuple[float, float]]:
    """The target alone's two measurements (one and four questions, run before and after the other
    rows) as one, its times the mean of the two; and the drift, last over first (one, four)."""
    merged = []
    for a, b in zip(first, last, strict=True):
        mean = {
            k: (a[k] + b[k]) / 2 for k in ("seconds", "decode_seconds", "ttft", "prepare_seconds") if k in a
        }
        merged.append({**a, **mean})
    return (merged[0], merged[1]), (
        last[0]["seconds"] / first[0]["seconds"],
        last[1]["seconds"] / first[1]["seconds"],
    )


def _rows_at(c: Clip, table: list[Row], results: dict, step: dict) -> list[dict]:
    ref = results["hf_generate"]
    base_one, base_four = results["target_alone"]
    # each question's own reference: HF generate's answers where they ran (not in --quick), else the
    # target alone's (whose first question's answer is checked against HF generate's, below)
    references = (ref[1] or base_four)["seqs"]
    t_step = base_one["stats"]["seconds_target_decode"] / max(1, base_one["stats"]["new_tokens"])
    out = []
    for row in table:
        one, four = results[row.name]
        st = one["stats"]
        recall, by_depth = (
            _recall(one["kept"], c) if row.method not in ("target_alone", "hf_generate") else (None, {})
        )
        drafted = sum(st.get("drafted_per_round", []))
        draft_step = st.get("seconds_draft_decode", 0.0) / drafted if drafted else None
        identical = (
            one["seq"] == ref[0]["seq"]
            and references[0] == ref[0]["seq"]
            and (four is None or four["seqs"] == references)
        )
        for workload, w, base in (("one_question", one, base_one), ("four_questions", four, base_four)):
            if w is None:  # not run (HF generate's four cold questions in --quick)
                continue
            mat = st.get("mat", 1.0) if workload == "one_question" else four["mat"]
            out.append(
                {
                    "visual_tokens": c.tokens,
                    "workload": workload,
                    "method": row.method,
                    "selector": None if row.method in ("target_alone", "hf_generate") else row.selector,
                    "keep_ratio": row.keep_ratio if row.selector != "full" else 1.0,
                    "mat": mat,
                    "needle_recall": recall,
                    "needle_recall_by_depth": by_depth,
                    "e2e_speedup": base["seconds"] / w["seconds"],
                    "decode_speedup": base["decode_seconds"] / w["decode_seconds"]
                    if w["decode_seconds"] > 0
                    else math.nan,
                    "draft_cost_ratio": draft_step / t_step if draft_step else None,
                    "ttft_s": one["ttft"] if workload == "one_question" else None,
                    "prefill_share": (one["ttft"] / one["seconds"])
                    if workload == "one_question"
                    else four.get("prepare_seconds", 0.0) / four["seconds"],
                    "seconds": w["seconds"],
                    "decode_seconds": w["decode_seconds"],
                    "peak_mib": w["peak"] / MiB,
                    "extra_mib": w["extra"] / MiB,
                    "identical": identical,
                    "rounds": st.get("emitted_per_round", []) if workload == "one_question" else None,
                    "t_decode_over_bound": step["decode_over_bound"],
                    "t_verify_over_bound": step["verify_over_bound"],
                    "keep_ratio_used": keep_used(
                        row, [st] if workload == "one_question" else w.get("asks", [])
                    ),
                    "projected_e2e": long_projection(
                        row.method,
                        [st if "new_tokens" in st else {"new_tokens": len(one["seq"])}]
                        if workload == "one_question"
                        else w.get("asks") or _ar_asks(w),
                        c.tokens,
                        row.keep_ratio if row.selector != "full" else 1.0,
                    ),
                }
            )
    return out


def keep_used(row: Row, asks: list[dict]) -> float | list[float] | None:
    """The keep ratio each answer's draft used: `auto`'s choice (its plan's `keep`), else the row's
    own; one value for one question, a list for a prepared video's; None without a draft (for an
    answer `auto` gave the target alone)."""
    if row.method in ("target_alone", "hf_generate"):
        return None
    own = row.keep_ratio if row.selector != "full" else 1.0

    def used_by(stats: dict) -> float | None:
        plan = stats.get("plan", {})
        if plan.get("schedule") == "autoregressive":
            return None
        return float(plan.get("keep", {}).get("ratio", own))

    used = [used_by(s) for s in asks]
    return used[0] if len(used) == 1 else used


def _ar_asks(w: dict) -> list[dict]:
    """HF generate's four cold answers as stats (it reports none): their new tokens."""
    return [{"new_tokens": len(s)} for s in w.get("seqs", [])]


def _mat_ci(emitted: list[int]) -> tuple[float, float, float]:
    """MAT with a 95% normal interval over rounds (the rounds of one answer)."""
    if not emitted:
        return 1.0, 1.0, 1.0
    m = statistics.fmean(emitted)
    half = 1.96 * statistics.stdev(emitted) / math.sqrt(len(emitted)) if len(emitted) > 1 else 0.0
    return m, m - half, m + half


def _wilson(k: int, n: int) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    z, p = 1.96, k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


#: held-out clips (each asked the four questions) of `mat_order_clips`
MAT_CLIPS = 8


def mat_order_clips(tokens: int, log: Callable[[str], None], clips: int = MAT_CLIPS) -> dict:
    """The MAT order at keep 10% over `clips` held-out clips of `tokens` visual tokens, four questions
    each (`lists_eval.mat_by_selection`: exact from teacher forcing, no timing), with 95% intervals over
    the answers. On the trained, unwidened models, whose outputs the widened ones equal, at a quarter
    of the prefill's cost."""
    from hippo.cli.pair.checkpoint import load_pair

    from .lists_eval import mat_by_selection
    from .pair import LISTS_DIR

    t0 = time.perf_counter()
    target, draft, tok = load_pair(wide=False, directory=LISTS_DIR)
    res = mat_by_selection(target, draft, tok, tokens, clips)
    h, u, f = res["holistic"], res["uniform"], res["full"]
    res.update(
        paper="holistic > attention-only > uniform at keep 10%",
        holistic_ge_attention_ge_uniform=h["mat"] >= res["attention"]["mat"] >= u["mat"],
        holistic_above_uniform_intervals_apart=h["ci95"][0] > u["ci95"][1],
        full_over_uniform=f["mat"] / u["mat"],
        holistic_over_oracle=h["mat"] / res["oracle"]["mat"],
        seconds=time.perf_counter() - t0,
    )
    log(f"MAT order over {res['answers']} answers at N = {tokens}: {res}")
    return res


def claims(summary: dict, target: Any, tok: Any, c: Clip, log: Callable[[str], None]) -> dict:
    """The paper's claims beside this run's figures (95% intervals where a figure is a share or a mean)."""
    from hippo.cli.bias import position_bias

    one = [r for r in summary["rows"] if r["workload"] == "one_question"]

    def find(n: int, method: str, selector: str | None, keep: float | None = 0.1) -> dict | None:
        for r in one:
            if (
                r["visual_tokens"] == n
                and r["method"] == method
                and r["selector"] == selector
                and (selector in (None, "full") or abs(r["keep_ratio"] - keep) < 1e-9)
            ):
                return r
        return None

    pipe = hippo.PipelineBuilder().target(target).scorer("holistic").scheduler("autoregressive").build()
    try:
        bias = position_bias(pipe, c.inputs, keep_ratio=0.1)
    finally:
        pipe.close()
    k = max(1, round(0.1 * bias["tokens"]))
    border = {}
    for name, m in bias["methods"].items():
        share = m["boundary_share"]
        border[name] = {"share": share, "ci95": _wilson(round(share * k), k)}
    out: dict[str, Any] = {
        "position_bias": {
            "paper": "attention-only top-10% keeps 44-58% border tokens against a base rate of ~20%",
            "visual_tokens": bias["tokens"],
            "base_rate": bias["base_rate"],
            **border,
            "reproduced": border["attention"]["ci95"][0] > bias["base_rate"],
        }
    }
    order = {}
    for n in sorted({r["visual_tokens"] for r in one}):
        mats = {s: find(n, "serial", s) for s in ("holistic", "attention", "uniform", "full")}
        if any(v is None for v in mats.values()):
            continue
        ci = {s: _mat_ci(r["rounds"]) for s, r in mats.items()}
        order[n] = {
            **{s: {"mat": v[0], "ci95": [v[1], v[2]]} for s, v in ci.items()},
            "holistic_ge_attention_ge_uniform": ci["holistic"][0] >= ci["attention"][0] >= ci["uniform"][0],
            "full_over_uniform": ci["full"][0] / ci["uniform"][0],
            "holistic_over_full": ci["holistic"][0] / ci["full"][0],
        }
    out["mat_order"] = {"paper": "holistic > attention-only > uniform at keep 10%", "by_n": order}
    big = max(r["visual_tokens"] for r in one)
    if big >= 4096:  # the same order over many answers, where one answer's rounds are too few to tell
        out["mat_order_clips"] = mat_order_clips(big, log)
    pays = {}
    for n in sorted({r["visual_tokens"] for r in one}):
        full, hol = find(n, "serial", "full"), find(n, "serial", "holistic")
        if full and hol:
            pays[n] = {
                "decode_phase": full["decode_seconds"] / hol["decode_seconds"],
                "e2e": full["seconds"] / hol["seconds"],
            }
    out["pruning_pays"] = {"paper": "SD on a 10% holistic selection beats SD on the full video", "by_n": pays}
    par = {}
    for n in sorted({r["visual_tokens"] for r in one}):
        ser, hip = find(n, "serial", "holistic"), find(n, "hippo", "holistic")
        if ser and hip:
            par[n] = {"hippo_over_serial_e2e": ser["seconds"] / hip["seconds"]}
    out["parallel"] = {
        "paper": "HIPPO's parallel schedule beats serial SD (draft and target on their own GPUs)",
        "by_n": par,
    }
    log(f"claims: {out}")
    return out


# ---- reporting ----------------------------------------------------------------------------------


def plots(summary: dict, out: Path) -> list[Path]:
    """MAT against N per selector, speedup against N, needle recall against depth (PNGs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one = [r for r in summary["rows"] if r["workload"] == "one_question"]
    keep = 0.1 if any(abs(r["keep_ratio"] - 0.1) < 1e-9 for r in one) else one[-1]["keep_ratio"]
    serial = [
        r
        for r in one
        if r["method"] == "serial" and (r["selector"] == "full" or abs(r["keep_ratio"] - keep) < 1e-9)
    ]
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for sel in SELECTORS:
        pts = sorted((r["visual_tokens"], r["mat"]) for r in serial if r["selector"] == sel)
        if pts:
            ax.plot(*zip(*pts), "o-", label=sel)
    ax.set(xscale="log", xlabel="visual tokens N", ylabel="MAT", title=f"serial SD, keep {keep:.0%}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "long_mat_vs_n.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for workload, style in (("one_question", "o-"), ("four_questions", "s--")):
        for method, sel in (
            ("auto", "holistic"),
            ("serial", "holistic"),
            ("serial", "full"),
            ("hippo", "holistic"),
        ):
            pts = sorted(
                (r["visual_tokens"], r["e2e_speedup"])
                for r in summary["rows"]
                if r["workload"] == workload
                and r["method"] == method
                and r["selector"] == sel
                and (sel == "full" or abs(r["keep_ratio"] - keep) < 1e-9)
            )
            if pts:
                ax.plot(*zip(*pts), style, label=f"{method} {sel}, {workload.replace('_', ' ')}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="visual tokens N", ylabel="e2e speedup over the target alone")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "long_speedup_vs_n.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    big = max(r["visual_tokens"] for r in one)
    for r in serial:
        if r["visual_tokens"] == big and r["needle_recall_by_depth"]:
            pts = sorted((float(d), v) for d, v in r["needle_recall_by_depth"].items())
            ax.plot(*zip(*pts), "o-", label=r["selector"])
    ax.set(
        xlabel="needle depth",
        ylabel="share of its tokens kept",
        title=f"needle recall, N = {big}, keep {keep:.0%}",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "long_recall_vs_depth.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _f(x: Any, spec: str = ".2f") -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def write_section(path: Path, report: str) -> None:
    """Put `report` (a long-video section) into the Markdown file at `path`, replacing its own."""
    text = path.read_text() if path.is_file() else ""
    before = text[: text.find(LONG_HEADING)] if section(text) else text
    path.write_text((before.rstrip() + "\n\n" if before.strip() else "") + report)


def claims_markdown(claims: dict) -> list[str]:
    pb = claims["position_bias"]
    lines = ["### The paper's claims, measured", ""]
    lines.append(
        f"- **Position bias** (paper: {pb['paper']}). Here, N = {pb['visual_tokens']}: attention-only top-10% keeps "
        f"{pb['attention']['share']:.0%} border tokens (95% CI {pb['attention']['ci95'][0]:.0%}-"
        f"{pb['attention']['ci95'][1]:.0%}), holistic {pb['holistic']['share']:.0%} "
        f"({pb['holistic']['ci95'][0]:.0%}-{pb['holistic']['ci95'][1]:.0%}), against a base rate of "
        f"{pb['base_rate']:.0%}: **{'reproduced' if pb['reproduced'] else 'not reproduced'}**."
    )
    order = claims["mat_order"]["by_n"]
    if order:
        parts = []
        for n, o in order.items():
            mats = ", ".join(
                f"{s} {o[s]['mat']:.2f} ({o[s]['ci95'][0]:.2f}-{o[s]['ci95'][1]:.2f})"
                for s in ("holistic", "attention", "uniform", "full")
            )
            verdict = "holds" if o["holistic_ge_attention_ge_uniform"] else "does not hold"
            if o["holistic"]["ci95"][0] <= o["uniform"]["ci95"][1]:
                verdict += " in the point estimates, but the intervals overlap"
            parts.append(f"N = {n}: {mats}; the order {verdict}")
        lines.append(
            f"- **MAT order at keep 10%** (paper: {claims['mat_order']['paper']}; 95% intervals over rounds). "
            + "; ".join(parts)
            + "."
        )
    oc = claims.get("mat_order_clips")
    if oc:
        mats = ", ".join(
            f"{s} {oc[s]['mat']:.2f} ({oc[s]['ci95'][0]:.2f}-{oc[s]['ci95'][1]:.2f})"
            for s in ("holistic", "attention", "uniform", "full", "oracle")
        )
        verdict = "holds" if oc["holistic_ge_attention_ge_uniform"] else "does not hold"
        apart = "apart" if oc["holistic_above_uniform_intervals_apart"] else "overlapping"
        lines.append(
            f"- **MAT order over {oc['answers']} answers** ({oc['clips']} held-out clips at N = {oc['visual_tokens']}, "
            "the four questions each; greedy chain drafting, γ = 5, exact from teacher forcing; 95% intervals over "
            f"answers): {mats}. The order {verdict}; holistic and uniform intervals {apart}; full / uniform "
            f"{oc['full_over_uniform']:.2f}, holistic / oracle {oc['holistic_over_oracle']:.2f}."
        )
    pays = claims["pruning_pays"]["by_n"]
    if pays:
        lines.append(
            "- **Pruning pays** (SD + holistic 10% over SD on the full video, decode phase / end to end): "
            + "; ".join(f"N = {n}: {p['decode_phase']:.2f}x / {p['e2e']:.2f}x" for n, p in pays.items())
            + "."
        )
    par = claims["parallel"]["by_n"]
    if par:
        lines.append(
            "- **Parallel against serial** (`hippo` over `serial`, both holistic 10%, end to end, measured on 2 "
            "cores, one per model): "
            + "; ".join(f"N = {n}: {p['hippo_over_serial_e2e']:.2f}x" for n, p in par.items())
            + "."
        )
    return lines


def _keep_text(used: float | list[float | None] | None) -> str:
    if used is None:
        return ""
    return " / ".join(
        "-" if u is None else _f(u, ".0%") for u in (used if isinstance(used, list) else [used])
    )


def run_line(run: dict, env: dict) -> str:
    """What was run, for how long, on what: the section's first line (so that a re-run writes it)."""
    minutes, seconds = divmod(round(run["seconds"]), 60)
    cpu = env.get("cpu_model", "this CPU")
    kernels = f", torch's CPU kernels {env['cpu_capability']}" if env.get("cpu_capability") else ""
    cores = f"{env['cpu_count']} logical CPUs" if env.get("cpu_count") else ""
    return (
        f"`{run['command']}` ({minutes} min {seconds} s, peak resident memory "
        f"{run['peak_rss_bytes'] / 1e9:.1f} GB) on {cpu} ({cores}{kernels}), one run, on "
        f"{env.get('date', 'an unknown date')}: the six-needle lists pair (`benchmarks/pair_lists/`, "
        "`docs/long-video.md`), one held-out clip per N for the timed rows. `auto` chooses the keep ratio "
        "per question where it drafts (`keep` shows the selector's own, `keep used` what its draft used; "
        '"-": no draft). `peak MiB` is the process\'s resident peak during the run / how far above its '
        "resident memory at the start the run went. What these figures say: `docs/figures.md`."
    )


def markdown(summary: dict) -> str:
    from .tables import markdown_table

    lines = [LONG_HEADING, ""]
    if summary.get("run"):
        lines += [run_line(summary["run"], summary.get("environment", {})), ""]
    lines += [
        f"Read bandwidth {summary['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; γ = {summary['gamma']}. Target step and "
        "(γ+1)-token verification against their bytes bound (weights + KV at that bandwidth); the target "
        "alone's drift is its last run's time over its first's (one question / four), around the other rows:",
        "",
    ]
    lines += markdown_table(
        [
            "N",
            "target prefill s",
            "t_decode ms",
            "× bound",
            "t_verify ms",
            "× bound",
            "KV MiB",
            "target alone drift",
        ],
        [
            [
                n,
                _f(s["t_target_prefill"]),
                _f(s["t_decode"] * 1e3, ".1f"),
                _f(s["decode_over_bound"]),
                _f(s["t_verify"] * 1e3, ".1f"),
                _f(s["verify_over_bound"]),
                _f(s["kv_bytes"] / MiB, ".1f"),
                " / ".join(_f(d, ".3f") for d in s.get("target_alone_drift", ())),
            ]
            for n, s in summary["steps"].items()
        ],
    )
    lines += [""]
    header = [
        "N",
        "workload",
        "method",
        "selector",
        "keep",
        "MAT",
        "needle recall",
        "e2e ×",
        "decode ×",
        "draft/target cost",
        "TTFT s",
        "prefill share",
        "peak MiB (process / the run's own)",
        "identical",
        "keep used",
        "projected e2e × (paper's hardware)",
    ]
    body = [
        [
            r["visual_tokens"],
            r["workload"],
            r["method"],
            r["selector"] or "",
            _f(r["keep_ratio"], ".0%"),
            _f(r["mat"]),
            _f(r["needle_recall"]),
            _f(r["e2e_speedup"]),
            _f(r["decode_speedup"]),
            _f(r["draft_cost_ratio"]),
            _f(r["ttft_s"]),
            _f(r["prefill_share"], ".0%"),
            f"{r['peak_mib']:.0f} / {_f(r.get('extra_mib'), '.0f')}",
            "yes" if r["identical"] else "**NO**",
            _keep_text(r.get("keep_ratio_used")),
            "–".join(_f(x) for x in r["projected_e2e"]["speedup"]) if r.get("projected_e2e") else "",
        ]
        for r in summary["rows"]
    ]
    lines += markdown_table(header, body)
    if summary.get("questions"):
        lines += [
            "",
            "Questions of the four-question workload: "
            + "; ".join(f"`{q}`" for q in summary["questions"])
            + ".",
        ]
    lines += [
        "",
        "Projected e2e: each row's measured rounds charged at the paper's Table 2 costs (72B/7B, 4x H200) "
        "scaled to the row's N (`benchmarks/projection.py`: prefill linear plus attention, a forward's "
        "weight and KV bytes); the range is Table 2's unknown N (12,544-25,088 visual tokens). A projection, "
        "not a measurement.",
    ]
    if summary.get("claims"):
        lines += ["", *claims_markdown(summary["claims"])]
    return "\n".join(lines) + "\n"


def main(
    *,
    quick: bool = False,
    out: str | os.PathLike = "results/bench-long",
    sweep: tuple[int, ...] | None = None,
    keep_ratios: tuple[float, ...] | None = None,
    gamma: int = 5,
    max_new_tokens: int = 96,
    threads: int = 2,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    import json

    from .report import environment

    started = time.perf_counter()
    report_file = Path(out) if str(out).endswith(".md") else None
    directory = Path("results/bench-long") if report_file is not None else Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    summary = run(
        quick=quick,
        sweep=sweep,
        keep_ratios=keep_ratios,
        gamma=gamma,
        max_new_tokens=max_new_tokens,
        threads=threads,
        seed=seed,
        log=log,
    )
    summary["environment"] = environment(seed, threads)
    summary["run"] = {
        "command": "hippo bench --long" + (" --quick" if quick else ""),
        "seconds": time.perf_counter() - started,
        # the process's own peak (ru_maxrss is in KiB on Linux); draft processes are not in it
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    rows_ = [{k: v for k, v in r.items() if k != "rounds"} for r in summary["rows"]]
    (directory / "results.json").write_text(
        json.dumps({"long": {**summary, "rows": rows_}}, indent=1, default=str)
    )
    (directory / "table.md").write_text(markdown(summary))
    if report_file is not None:  # e.g. benchmarks/RESULTS.md: its long-video section
        write_section(report_file, markdown(summary))
    written = plots(summary, directory)
    log(
        f"wrote {directory / 'results.json'}, {directory / 'table.md'} and {', '.join(p.name for p in written)}"
    )
    return summary
