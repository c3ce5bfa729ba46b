"""Calibrated law cases: the temperature at which a law check is checkable on an adapter's tiny target.

A law check (`hippo.testing.sampling`) is checkable when the target's exact law of the case's first
tokens gives its likeliest sequence at most `sampling.MAX_MODE` (so a pipeline that never samples is
seen) and reaches the stated power (`power.POWER` against a TV `power.EPSILON` error at level
`power.ALPHA`) within `max_runs`. Whether a given temperature is checkable depends on the backbone's
tiny target: the default case's T = 0.01 is on Qwen2.5-VL, but LLaVA-OneVision's law is too peaked
there (0.906 on one sequence) and Qwen3-VL's and video-SALMONN2+'s too flat (over 3,000 runs).

`calibrate` computes the temperature, from the target's own logits: the case's tree of outcomes under
top-k (the same at every temperature) is enumerated once (`score_tree`, one forward a node), its law
is then computed at each temperature of a grid around the stage's stock one (`law_at`: a softmax per
node), and the checkable temperature with the fewest runs is kept; the stock temperature itself
when it is checkable, so a backbone whose stock law works keeps it. `law_case(adapter, stage)` is the
settings of one stage of `hippo check --sampling` on an adapter, a third party's too; the law check
then enumerates the law at that temperature exactly and plans its runs on it (`LawCheck.plan`).
`python -m hippo.testing.calibration` prints every installed adapter's law cases (docs/law-checks.md).
Notation: p = target, T = temperature, N = a check's runs, k = top_k.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from hippo.errors import ConfigError
from hippo.testing import power as pw
from hippo.testing.models import eos_ids
from hippo.testing.reference import next_logits, warpers

#: the temperatures tried: the stock one times 2^(j / STEPS) for j in GRID (1/32x to 8x)
STEPS = 8
GRID = range(-5 * STEPS, 3 * STEPS + 1)
#: the power search (`power.runs_for`) runs on this many of the grid's laws: the most peaked under the cap
PEAKED = 6
#: at most this many nodes in a case's tree of outcomes (k = 3, 4 tokens: 40)
MAX_NODES = 400
# per process: calibrations by (law key, stock T, bounds)
_CALIBRATIONS: dict[tuple, Calibration] = {}


@attrs.frozen
class Calibration:
    """The calibrated temperature of one law case, and the check it gives."""

    temperature: float
    mode: float  # P of the likeliest sequence at that temperature
    runs: int  # N for the stated power
    power: float  # worst-case power of N runs against a TV `epsilon` error
    stock: bool  # the stage's stock temperature was checkable and is kept
    tried: int  # temperatures whose law was computed

    def summary(self) -> str:
        how = "the stock temperature" if self.stock else f"calibrated over {self.tried} temperatures"
        return (
            f"T={self.temperature:.4g} ({how}): mode {self.mode:.3f}, N = {self.runs}, power {self.power:.3f}"
        )


def score_tree(
    model: Any,
    inputs: dict,
    n_tokens: int,
    top_k: int,
    repetition_penalty: float | None = None,
    eos: set[int] | None = None,
    limit: int = MAX_NODES,
) -> dict[tuple[int, ...], torch.Tensor]:
    """{prefix: p's scores [V] after it (the repetition penalty applied)} for every prefix of every
    sequence of `n_tokens` tokens (or ended by an EOS) with positive probability under top-k. Top-k
    keeps the same tokens at every temperature, so this tree holds the outcomes at every T."""
    eos = eos if eos is not None else set(eos_ids(model))
    ids = inputs["input_ids"]
    penalty, keep = warpers(1.0, None, None, repetition_penalty), warpers(1.0, top_k)
    tree: dict[tuple[int, ...], torch.Tensor] = {}

    def walk(tokens: list[int]) -> None:
        if len(tokens) == n_tokens or (tokens and tokens[-1] in eos):
            return
        if len(tree) >= limit:
            raise ConfigError(
                f"the case's tree of outcomes has more than {limit} nodes: lower top_k or new_tokens"
            )
        seq = torch.cat([ids, torch.tensor([tokens], dtype=ids.dtype)], dim=1)  # [1, L + k]
        scores = penalty(seq, next_logits(model, inputs, tokens)[None].double().clone())  # [1, V]
        tree[tuple(tokens)] = scores[0]
        kept = torch.isfinite(keep(seq, scores.clone())[0]).nonzero().flatten().tolist()
        for t in kept:
            walk([*tokens, t])

    walk([])
    return tree


def law_at(
    tree: dict[tuple[int, ...], torch.Tensor], temperature: float, top_k: int, top_p: float | None = None
) -> dict[tuple[int, ...], float]:
    """The law of the tree's sequences at `temperature` (then top-k, top-p, as `generate` warps)."""
    proc = warpers(temperature, top_k, top_p)  # the penalty is in the tree's scores already
    dummy = torch.zeros(1, 1, dtype=torch.long)
    law: dict[tuple[int, ...], float] = {}

    def walk(tokens: tuple[int, ...], prob: float) -> None:
        if tokens not in tree:
            law[tokens] = prob
            return
        p = torch.softmax(proc(dummy, tree[tokens][None].clone())[0], -1)  # [V]
        for t in p.nonzero().flatten().tolist():
            walk((*tokens, t), prob * float(p[t]))

    walk((), 1.0)
    return law


def checkable(
    law: dict[tuple[int, ...], float],
    *,
    max_runs: int,
    max_mode: float,
    alpha: float = pw.ALPHA,
    epsilon: float = pw.EPSILON,
    power: float = pw.POWER,
) -> tuple[int, float] | None:
    """(N, its power) when `law` is checkable (mode <= max_mode, power reached within max_runs), else None."""
    if max(law.values()) > max_mode:
        return None
    n = pw.runs_for(law, alpha, power, epsilon, most=max_runs)
    got = pw.power_of(law, n, alpha, epsilon)
    return (n, got) if got >= power else None


def calibrate(
    tree: dict[tuple[int, ...], torch.Tensor],
    stock: float,
    top_k: int,
    top_p: float | None = None,
    *,
    max_runs: int = 3000,
    max_mode: float | None = None,
    alpha: float = pw.ALPHA,
    epsilon: float = pw.EPSILON,
    power: float = pw.POWER,
    what: str = "the case",
) -> Calibration:
    """The stock temperature when its law is checkable, else the checkable temperature of the grid
        (stock x 2^(j/8), 1/32x to 8x) with the fewest runs (ties: the nearest to stock), among its PEAKED
    most peaked laws under the cap. `VacuousCheck`
        when no temperature is checkable (every law too peaked, or too flat for max_runs)."""
    from hippo.testing.report import VacuousCheck
    from hippo.testing.sampling import MAX_MODE

    cap = MAX_MODE if max_mode is None else max_mode
    bounds = {"max_runs": max_runs, "max_mode": cap, "alpha": alpha, "epsilon": epsilon, "power": power}
    found = checkable(law_at(tree, stock, top_k, top_p), **bounds)
    if found is not None:
        law = law_at(tree, stock, top_k, top_p)
        return Calibration(stock, max(law.values()), found[0], found[1], True, 1)
    laws = {j: law_at(tree, stock * 2.0 ** (j / STEPS), top_k, top_p) for j in GRID if j != 0}
    modes = {j: max(law.values()) for j, law in laws.items()}
    # the power search runs on the PEAKED most peaked laws under the cap: a flatter law needs more runs
    under = sorted((j for j in laws if modes[j] <= cap), key=lambda j: -modes[j])[:PEAKED]
    best: tuple[tuple[int, int], Calibration] | None = None
    for j in under:
        found = checkable(laws[j], **bounds)
        if found is not None and (best is None or (found[0], abs(j)) < best[0]):
            t = stock * 2.0 ** (j / STEPS)
            best = ((found[0], abs(j)), Calibration(t, modes[j], found[0], found[1], False, len(laws) + 1))
    if best is None:
        raise VacuousCheck(
            f"no temperature from {stock / 32:.3g} to {stock * 8:.3g} makes {what} checkable with top_k={top_k}: "
            f"the likeliest sequence holds {min(modes.values()):.3f} to {max(modes.values()):.3f} of the law, and no law with at "
            f"most {cap:g} on it reaches power {power:g} within max_runs = {max_runs}: raise max_runs, or "
            "change top_k or the case"
        )
    return best[1]


def calibrated(
    key: tuple,
    tree: Any,  # () -> score_tree(...)
    stock: float,
    top_k: int | None,
    top_p: float | None = None,
    what: str = "the case",
    **bounds: Any,
) -> Calibration:
    """`calibrate` on the tree `tree()` builds, cached per process under `key` (the law's own key)."""
    if not top_k:
        raise ConfigError(
            "a calibrated temperature needs top_k (the outcomes must be enumerable at every temperature): "
            "pass top_k, or pass temperature="
        )
    full = (key, stock, top_k, top_p, tuple(sorted(bounds.items())))
    if full not in _CALIBRATIONS:
        _CALIBRATIONS[full] = calibrate(tree(), stock, top_k, top_p, what=what, **bounds)
    return _CALIBRATIONS[full]


#: the stages of `hippo check --sampling` (`plugin_check.sampling_plan`), each a law case
STAGES = ("default", "token trees", "conversation turn 2")


def law_case(adapter: str | None = None, stage: str = "default", **bounds: Any) -> dict[str, Any]:
    """The settings of `stage`'s law check on `adapter` (default: `sampling.default_adapter()`): the
    stage's own (DEFAULTS, TREE_SETTINGS, SECOND_TURN) with its temperature calibrated on the adapter's
    tiny target (`calibrate`), and "calibration": the `Calibration`. `bounds`: max_runs, max_mode,
    alpha, epsilon, power."""
    from hippo.testing import sampling as hs

    if stage not in STAGES:
        raise ConfigError(f"stage {stage!r} is not one of {', '.join(STAGES)}")
    adapter = adapter or hs.default_adapter()
    if stage == "conversation turn 2":
        settings = {k: v for k, v in hs.SECOND_TURN.items() if k in ("temperature", "top_k", "new_tokens")}
        cal = hs.second_turn_calibration(adapter, **bounds)
    else:
        settings = {**hs.DEFAULTS, **(hs.TREE_SETTINGS if stage == "token trees" else {})}
        case = hs.sampling_case(adapter, new_tokens=settings["new_tokens"])
        cal = hs.case_calibration(
            case,
            settings["temperature"],
            settings["top_k"],
            settings["top_p"],
            settings["repetition_penalty"],
            **bounds,
        )
    return {**settings, "temperature": cal.temperature, "calibration": cal}


__all__ = ["Calibration", "STAGES", "calibrate", "checkable", "law_at", "law_case", "score_tree"]


def table() -> None:  # pragma: no cover - a report
    """Print each registered adapter's law case for every stage, with its law's figures."""
    from hippo.testing import sampling as hs
    from hippo.testing.models import tiny_adapters

    print(f"{'adapter':<22} {'stage':<20} {'T':>22} {'P(mode)':>7} {'N':>5} {'power':>6}")
    for adapter in tiny_adapters():
        for stage in STAGES:
            case = law_case(adapter, stage)
            t = case["temperature"]
            if stage == "conversation turn 2":
                law = hs.second_turn_law(adapter, t)
            else:
                law = hs.target_law(hs.sampling_case(adapter), t, case["top_k"])
            check = hs.LawCheck.plan(law)
            how = "" if case["calibration"].stock else " (calibrated)"
            print(
                f"{adapter:<22} {stage:<20} {f'{t:.4g}{how}':>22} {check.result.mode:>7.3f} {check.runs:>5} "
                f"{check.result.power:>6.3f}"
            )


if __name__ == "__main__":  # pragma: no cover
    torch.set_num_threads(1)
    table()
