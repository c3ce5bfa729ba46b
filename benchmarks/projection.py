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
