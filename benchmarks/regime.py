"""The cost regime of a benchmark run, measured beside the paper's.

Three quantities decide whether speculative decoding can win, and by how much:
- the prefill share of the target-alone run (paper, Table 2: 33.71 s of 164.84 s = 20%);
- the draft's cost per token over the target's (paper: a 7B draft for a 72B target, ~1/10);
- whether the target's decode step is bound by reading its weights (bytes per step / seconds per
  step, against the machine's bandwidth), which is what makes verifying γ+1 tokens cost about one step.

`measure_costs` times single forwards through hippo's own sessions (the same calls the schedulers
make); `regime` puts them beside the paper's figures.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from hippo.registry import lookup
from hippo.session import PackedSessions

#: HIPPO Table 2 (video-SALMONN2+ 7B draft / 72B target, 4x H200, 256 new tokens, seconds)
PAPER = {
    "target_prefill": 33.71,
    "target_decode_ar": 131.13,
    "target_decode_hippo": 25.11,
    "draft_prefill": 2.79,
    "draft_decode": 23.77,
    "pruning": 0.11,
    "total_ar": 164.84,
    "total_hippo": 58.82,
    "new_tokens": 256,
    "draft_params_b": 7.0,
    "target_params_b": 72.0,
}
PAPER_PREFILL_SHARE = PAPER["target_prefill"] / PAPER["total_ar"]
PAPER_COST_RATIO = PAPER["draft_params_b"] / PAPER["target_params_b"]  # decode is bandwidth-bound on GPUs
PAPER_SPEEDUP = PAPER["total_ar"] / PAPER["total_hippo"]


def lm_weight_bytes(model: Any) -> int:
    """Bytes a decode step reads: every parameter outside the vision encoder (KV cache not counted)."""
    return sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if ".visual." not in f".{name}" and "vision_tower" not in name
    )


def _forward_seconds(session, k: int, repeats: int) -> float:
    """Median seconds of a k-token forward, rolled back after each."""
    L = session.length
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        session.forward(torch.full((k,), 5))
        times.append(time.perf_counter() - t0)
        session.rollback(L)
    return statistics.median(times)


def measure_costs(
    target: Any,
    draft: Any,
    inputs: dict,
    gamma: int,
    keep_ratio: float,
    *,
    threads: int,
    repeats: int = 7,
    compiled: bool = False,
) -> dict:
    """Per-forward seconds of the target (decode, γ+1 verification) and the draft (full and pruned).
    The target's are timed as hippo runs it by default, with packed linear weights (`hippo.packed`;
    a one-token step does not use them), and its verification also without them (MKL's small-M
    GEMMs); `compiled`: also on a compiled static-cache session (`hippo.static`), which compiles its
    graphs here (the bench's compiled rows then reuse them)."""
    torch.set_num_threads(threads)
    qwen = lookup("adapters", "qwen2_5_vl")
    ta, da = qwen(target), qwen(draft)
    encoded = ta.encode(inputs)
    t0 = time.perf_counter()
    session = ta.prefill(encoded, None)
    prefill = time.perf_counter() - t0
    out = {
        "threads": threads,
        "t_target_prefill": prefill,
        "t_verify_unpacked": _forward_seconds(session, gamma + 1, repeats),
    }
    session = PackedSessions().open(session, 0)  # as hippo runs its target by default
    out["t_decode"] = _forward_seconds(session, 1, repeats)
    out["t_verify"] = _forward_seconds(session, gamma + 1, repeats)
    out["packed_bytes"] = session.packed.bytes
    if compiled:
        from hippo.static import StaticSessions

        static = StaticSessions().open(session, gamma + 1)
        t0 = time.perf_counter()
        for k in (1, gamma + 1):  # compile (or load from inductor's cache) both graphs
            _forward_seconds(static, k, 1)
        out["seconds_compile"] = time.perf_counter() - t0
        out["t_decode_compiled"] = _forward_seconds(static, 1, repeats)
        out["t_verify_compiled"] = _forward_seconds(static, gamma + 1, repeats)
        session = static
    session.close()
    d_encoded = da.encode(inputs)
    n = d_encoded.visual.n
    keep = torch.linspace(0, n - 1, max(1, round(keep_ratio * n))).round().long().unique()
    for tag, kept in (("full", None), ("pruned", keep)):
        s = da.prefill(d_encoded, kept)
        out[f"t_draft_{tag}"] = _forward_seconds(s, 1, repeats)
        s.close()
    out["weight_bytes"] = lm_weight_bytes(target)
    out["target_params"] = sum(p.numel() for p in target.parameters())
    out["draft_params"] = sum(p.numel() for p in draft.parameters())
    return out


def regime(costs: dict, hf_prefill_share: float | None) -> dict:
    """The three calibration quantities, ours beside the paper's."""
    gbps = costs["weight_bytes"] / costs["t_decode"] / 1e9
    return {
        "prefill_share": hf_prefill_share,
        "paper_prefill_share": PAPER_PREFILL_SHARE,
        "draft_cost_ratio_full": costs["t_draft_full"] / costs["t_decode"],
        "draft_cost_ratio_pruned": costs["t_draft_pruned"] / costs["t_decode"],
        "paper_draft_cost_ratio": PAPER_COST_RATIO,
        "target_weight_mb": costs["weight_bytes"] / 1e6,
        "decode_gb_per_s": gbps,
        "verify_over_decode": costs["t_verify"] / costs["t_decode"],
        "verify_over_decode_unpacked": costs["t_verify_unpacked"] / costs["t_decode"],
        **(
            {"verify_over_decode_compiled": costs["t_verify_compiled"] / costs["t_decode_compiled"]}
            if "t_verify_compiled" in costs
            else {}
        ),
    }


def regime_markdown(r: dict, costs: dict, gamma: int) -> str:
    share = "n/a" if r["prefill_share"] is None else f"{r['prefill_share']:.0%}"
    return "\n".join(
        [
            "| regime | this run | paper (Table 2, 7B/72B on 4x H200) |",
            "|---|---|---|",
            f"| prefill share of the target-alone run | {share} | {r['paper_prefill_share']:.0%} |",
            f"| draft / target cost per token | 1/{1 / r['draft_cost_ratio_full']:.1f} full video, "
            f"1/{1 / r['draft_cost_ratio_pruned']:.1f} pruned | 1/{1 / r['paper_draft_cost_ratio']:.1f} (7B/72B) |",
            f"| target decode step | {costs['t_decode'] * 1e3:.2f} ms, reads {r['target_weight_mb']:.0f} MB of "
            f"weights: {r['decode_gb_per_s']:.1f} GB/s ({costs['threads']} threads) | "
            f"{PAPER['target_decode_ar'] / PAPER['new_tokens'] * 1e3:.0f} ms |",
            f"| t_verify(γ+1={gamma + 1}) / t_decode, as hippo runs it (packed weights, "
            f"{costs['packed_bytes'] / 1e6:.0f} MB more) | {r['verify_over_decode']:.2f} "
            f"({costs['t_verify'] * 1e3:.2f} ms) | ~1 on a GPU |",
            f"| the same, unpacked (MKL's small-M GEMMs) | {r['verify_over_decode_unpacked']:.2f} "
            f"({costs['t_verify_unpacked'] * 1e3:.2f} ms) | |",
            *(
                [
                    f"| the same, compiled static-cache target (`.compile('target')`) | "
                    f"{r['verify_over_decode_compiled']:.2f} ({costs['t_verify_compiled'] * 1e3:.2f} / "
                    f"{costs['t_decode_compiled'] * 1e3:.2f} ms; compiling took {costs['seconds_compile']:.0f} s) | |"
                ]
                if "verify_over_decode_compiled" in r
                else []
            ),
        ]
    )
