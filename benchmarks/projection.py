"""A projection to the paper's hardware: this run's acceptance, replayed with the paper's forward costs.

This CPU cannot show what a schedule does where a GPU's costs hold (verifying γ+1 tokens costs
about one decode step; each model has its own device). The projection keeps what this run really
measured, which tokens each round accepted, and charges every forward what it costs in the
paper's Table 2 (video-SALMONN2+ 72B target, 7B draft, 4x H200, 256 new tokens):

- target prefill (vision + language model): 33.71 s;
- target forward, decode or verification alike: 131.13 s / 256 = 0.512 s;
- draft prefill (pruned video): 2.79 s;
- draft forward: 0.512 s x 7/72 = 0.050 s (bandwidth-bound decoding scales with the weights).

Serial rows are charged in closed form from their per-round counts. Parallel rows (`pearl`,
`hippo`) are re-run on the `simulated` executor with these durations, so draft and target overlap
on its virtual clock exactly as the schedule decides; with `gamma="auto"` their cost model is given
the paper's verify curve (one forward at any width), not this CPU's. It is a projection, labelled as
such, not a measurement.
"""

from __future__ import annotations

from typing import Any

from hippo.benchmarks.regime import PAPER
from hippo.cost import VerifyCurve

T_FORWARD = PAPER["target_decode_ar"] / PAPER["new_tokens"]
COSTS = {
    "target_prefill": PAPER["target_prefill"],
    "target_forward": T_FORWARD,
    "draft_prefill": PAPER["draft_prefill"],
    "draft_forward": T_FORWARD * PAPER["draft_params_b"] / PAPER["target_params_b"],
}


def autoregressive_seconds(new_tokens: int) -> float:
    return COSTS["target_prefill"] + new_tokens * COSTS["target_forward"]


def serial_seconds(stats: dict) -> float:
    """Target prefill, then the draft's, then per round γ draft forwards and one verification."""
    drafted = sum(stats["drafted_per_round"])
    return (
        COSTS["target_prefill"]
        + COSTS["draft_prefill"]
        + drafted * COSTS["draft_forward"]
        + stats["rounds"] * COSTS["target_forward"]
    )


def paper_curve() -> VerifyCurve:
    """t_verify(k) on the paper's hardware for `gamma="auto"` rows: one target forward, any width (a
    replay must not choose γ from this CPU's verify curve while paying the paper's costs)."""
    return VerifyCurve({1: COSTS["target_forward"], 64: COSTS["target_forward"]})


def simulated_options(options: dict[str, Any]) -> dict[str, Any]:
    """A parallel row's scheduler options, moved onto the simulated executor with the paper's costs."""
    return {**options, "executor": "simulated", "executor_options": dict(COSTS)}


# ---- long videos: Table 2's costs scaled with the number of visual tokens N ---------------------
#
# Table 2 does not give its N. The paper's appendix gives LLaVA-OneVision 196 x 64 and 196 x 128
# visual tokens and says the other models' frame rates were set for inputs of comparable length,
# so Table 2's N0 lies in PAPER_N (a projection at N is given for both ends: its range). The model,
# per forward or prefill at N visual tokens (x = N / N0):
#
# - target prefill: 33.71 s x x (1 - b + b x): linear (the vision encoder, which dominates a video-LLM's
#   prefill, and the language model's projections) and b the attention's share of the language
#   model's prefill FLOPs at N0 (Qwen2.5-72B: 4 x 80 layers x 8,192 attention width x N0/2 per token
#   against 2 x 72e9 of projections: `attention_share`);
# - target forward (decode or verification, bandwidth-bound): 0.512 s x (W + k N) / (W + k N0), W the
#   72B's weights and k its KV bytes per token (bf16: 80 layers x 2 x 8 heads x 128 x 2 bytes);
# - draft prefill: 2.79 s x x (its vision encoder reads every frame; the pruned language model's
#   prefill is small), plus, for a draft that keeps a share r > 0.1 of the video, its language
#   model's extra 2 x 7e9 x (r - 0.1) N FLOPs at DRAFT_FLOPS;
# - draft forward: 0.050 s x (W_d + k_d r N) / (W_d + k_d 0.1 N0) (the 7B: weights and KV per token).

PAPER_N = (196 * 64, 196 * 128)
TARGET_WEIGHT_BYTES = 72e9 * 2
TARGET_KV_BYTES = 80 * 2 * 8 * 128 * 2  # per token
DRAFT_WEIGHT_BYTES = 7e9 * 2
DRAFT_KV_BYTES = 28 * 2 * 4 * 128 * 2
DRAFT_FLOPS = 400e12  # FLOP/s of the draft's prefill on one H200 (bf16, about half its peak)


def attention_share(n0: int) -> float:
    """The attention's share of Qwen2.5-72B's language-model prefill FLOPs at n0 tokens (causal)."""
    attention = 4 * 80 * 8192 * n0 / 2
    return attention / (attention + 2 * 72e9)


def long_costs(n: int, keep_ratio: float, n0: int) -> dict[str, float]:
    """Table 2's costs (`COSTS`) scaled to n visual tokens from the paper's n0 (the model above)."""
    x, b = n / n0, attention_share(n0)
    kv = TARGET_KV_BYTES
    draft_tokens = keep_ratio * n
    return {
        "target_prefill": COSTS["target_prefill"] * x * (1 - b + b * x),
        "target_forward": COSTS["target_forward"]
        * (TARGET_WEIGHT_BYTES + kv * n)
        / (TARGET_WEIGHT_BYTES + kv * n0),
        "draft_prefill": COSTS["draft_prefill"] * x + max(0.0, keep_ratio - 0.1) * n * 2 * 7e9 / DRAFT_FLOPS,
        "draft_forward": COSTS["draft_forward"]
        * (DRAFT_WEIGHT_BYTES + DRAFT_KV_BYTES * draft_tokens)
        / (DRAFT_WEIGHT_BYTES + DRAFT_KV_BYTES * 0.1 * n0),
    }


def long_answer_seconds(method: str, stats: dict, costs: dict[str, float]) -> float:
    """One answer's decoding on the paper's hardware, from its measured rounds (no prefill):

    - the target alone (and HF generate): one target forward per new token;
    - serial SD (`serial`, `self_spec`): per round its γ draft forwards, then one verification;
    - parallel (`hippo`, and `auto` whatever it chose: its best case): per round the longer of the
      verification and the draft's next γ forwards (PEARL's overlap, each model on its own GPUs).
    """
    if method in ("target_alone", "hf_generate") or not stats.get("rounds"):
        return stats.get("new_tokens", 0) * costs["target_forward"]
    drafted = stats.get("drafted_per_round", [])
    f_t, f_d = costs["target_forward"], costs["draft_forward"]
    if method in ("hippo", "auto"):
        rounds = sum(max(f_t, d * f_d) for d in drafted) + f_t * stats.get("target_steps", 0)
    else:
        rounds = sum(drafted) * f_d + len(drafted) * f_t
    return rounds


def long_projection(method: str, asks: list[dict], n: int, keep_ratio: float) -> dict[str, Any]:
    """A long row's end-to-end seconds on the paper's hardware at both ends of `PAPER_N`: the target's
    prefill once (a prepared video's questions share it), the draft's prefill once where a draft
    runs (overlapped with the target's in `hippo`/`auto`), and every answer's decoding
    (`long_answer_seconds`); with the target alone's seconds for the same answers, and the speedup."""
    drafts = method not in ("target_alone", "hf_generate")
    out: dict[str, Any] = {"label": "projection to the paper's hardware (4x H200, 72B/7B), not a measurement"}
    seconds, alone = [], []
    for n0 in PAPER_N:
        costs = long_costs(n, keep_ratio if drafts else 1.0, n0)
        prefills = 1 if method != "hf_generate" else len(asks)  # HF generate has no prepared video
        draft_prefill = costs["draft_prefill"] if drafts else 0.0
        if method in ("hippo", "auto"):
            draft_prefill = max(0.0, draft_prefill - costs["target_prefill"])  # overlapped
        decode = sum(long_answer_seconds(method, s, costs) for s in asks)
        seconds.append(prefills * costs["target_prefill"] + draft_prefill + decode)
        tokens = sum(s.get("new_tokens", 0) for s in asks)
        alone.append(costs["target_prefill"] + tokens * costs["target_forward"])
    speedups = [a / s for a, s in zip(alone, seconds)]
    out.update(
        {
            "paper_n0": list(PAPER_N),
            "seconds": [min(seconds), max(seconds)],
            "target_alone_seconds": [min(alone), max(alone)],
            "speedup": [min(speedups), max(speedups)],
        }
    )
    return out


# ---- batches: a decode step of B rows on the paper's hardware ----------------------------------
#
# A decode or verification forward of B rows reads the weights once and each row's KV cache: on the
# paper's hardware (bandwidth-bound) it costs Table 2's forward scaled by (W + B c) / (W + c), c one
# row's KV at Table 2's context (N0 visual tokens, both ends of `PAPER_N`); the draft's likewise,
# its KV at a 10% keep. Compute stays under the bandwidth bound for B (γ+1) ≤ 8 x 17 tokens on an
# H200 (989 TFLOP/s bf16 against 4.8 TB/s: about 200 FLOP per byte read; a 72B forward of B k tokens
# does 2 x 72e9 x B k FLOP over 144e9 bytes, B k FLOP per byte).


def batch_forwards(rows: int, n0: int) -> tuple[float, float]:
    """(target, draft) seconds of one forward of `rows` rows on the paper's hardware at n0 tokens."""
    c_t, c_d = TARGET_KV_BYTES * n0, DRAFT_KV_BYTES * 0.1 * n0
    t = COSTS["target_forward"] * (TARGET_WEIGHT_BYTES + rows * c_t) / (TARGET_WEIGHT_BYTES + c_t)
    d = COSTS["draft_forward"] * (DRAFT_WEIGHT_BYTES + rows * c_d) / (DRAFT_WEIGHT_BYTES + c_d)
    return t, d


def batch_rounds(outs: list[Any]) -> tuple[list[int], int]:
    """A batch's rounds from its rows' stats (rows that started together): the draft tokens of each
    verification round (the most any row drafted in it), and the target-only steps (the most of any
    row); a target-alone batch has one step per new token of its longest row."""
    stats = [o.stats for o in outs]
    longest = max((len(s.drafted_per_round) for s in stats), default=0)
    drafted = [
        max(s.drafted_per_round[r] for s in stats if r < len(s.drafted_per_round)) for r in range(longest)
    ]
    steps = max(((s.target_steps or 0) for s in stats), default=0)
    if not longest:  # the target alone: every token after the first is one step
        steps = max(s.new_tokens for s in stats) - 1
    return drafted, steps


def batch_decode_projection(outs: list[Any], parallel: bool) -> dict[str, Any]:
    """The decode phase (after every row's first token) of a batch on the paper's hardware, charged
    with the batch's measured rounds (`batch_rounds`) at `batch_forwards`' costs: a serial round is
    its γ draft forwards then one verification; a parallel one (`pearl`/`hippo`, q on its own GPUs)
    the longer of the verification and q's next block of γ+1 tokens, plus one draft forward before
    it where q drafted one token first (pre-verify). Tokens/s, and the speedup over the target alone
    on the same rows (one step per token), at both ends of `PAPER_N`."""
    drafted, steps = batch_rounds(outs)
    rows = len(outs)
    tokens = sum(o.stats.new_tokens - 1 for o in outs)
    alone_steps = max(o.stats.new_tokens for o in outs) - 1
    rates, speedups = [], []
    for n0 in PAPER_N:
        f_t, f_d = batch_forwards(rows, n0)
        if parallel:
            rounds = sum(max(f_t, (d + 1) * f_d) + (f_d if d == 1 else 0.0) for d in drafted)
        else:
            rounds = sum(d * f_d + f_t for d in drafted)
        seconds = rounds + steps * f_t
        rates.append(tokens / seconds if seconds > 0 else float("nan"))
        speedups.append(alone_steps * f_t / seconds if seconds > 0 else float("nan"))
    return {
        "label": "projection to the paper's hardware (72B/7B, bandwidth-bound forwards), decode phase, not a measurement",
        "paper_n0": list(PAPER_N),
        "tok_s": [min(rates), max(rates)],
        "speedup_over_target_alone": [min(speedups), max(speedups)],
    }
