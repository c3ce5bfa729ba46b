"""`assert_sampling_exact`: a statistical test of the pipeline's law against the target's exact law.

Two tests, both against p computed exactly from the target's own forward passes, processed with the
warpers `generate` applies:

- the surprisal test, sensitive to a sampler that is too hot or too cold. Along each sampled path,
  D_t = -log p_t(x_t) - H(p_t) has mean 0 given the past, and conditional variance
  V_t = Var_{p_t}(log p_t), both computed exactly; Z = sum D_t / sqrt(sum V_t) is then N(0, 1)
  (martingale central limit theorem) for an exact sampler. A sampler whose temperature is off by
  a factor 1 + e shifts each D_t by about e V_t, so Z by e sqrt(sum V_t). The check samples until
  sum V_t is large enough to detect `sensitivity` (0.1: a temperature 10% off) with 99% power at
  the two-sided level `delta`, then requires |Z| <= z(delta);
- when the outcomes can be enumerated (top_k ** new_tokens <= 256), the total-variation distance
  between the sampled sequences and the exact joint law, with a McDiarmid bound at level `delta`.

Both also require every sampled token to have p > 0 and, when the pipeline drafts, some round that
accepted part of its draft (so the rejection and residual paths really ran).
Notation: p = target, q = draft, γ = draft length, V = vocabulary size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Any

import attrs
import torch

from hippo.errors import ConfigError
from hippo.testing.case import Case
from hippo.testing.drafters import corrupting_plugin
from hippo.testing.greedy import make_pipeline, part_names
from hippo.testing.models import Prompt, eos_ids, pixel_unit, text_ids, tiny, tiny_adapters
from hippo.testing.reference import exact_law, path_logits, total_variation, tv_threshold, warpers
from hippo.testing.report import LosslessViolation, Report, VacuousCheck

POWER = 0.99
MAX_OUTCOMES = 256
# per process: the target's raw logits along sampled paths, and enumerated laws (float64, exact)
_PATHS: dict[tuple, dict[tuple[int, ...], torch.Tensor]] = {}
_LAWS: dict[tuple, dict[tuple[int, ...], float]] = {}


@attrs.define
class SamplingResult:
    runs: int = 0
    tokens: int = 0
    z: float = 0.0  # the surprisal statistic
    z_bound: float = 0.0
    information: float = 0.0  # sum of V_t
    detectable: float = math.inf  # smallest relative temperature error detected with 99% power
    tv: float | None = None
    tv_bound: float | None = None
    outcomes: int | None = None  # outcomes of the enumerated law
    rounds: int = 0
    partial_rounds: int = 0
    rejected_rounds: int = 0

    def summary(self) -> str:
        out = (
            f"{self.runs} runs, {self.tokens} tokens: surprisal Z = {self.z:+.2f} (|Z| <= {self.z_bound:.2f}), "
            f"detects a temperature off by {100 * self.detectable:.1f}%"
        )
        if self.tv is not None:
            out += f"; TV {self.tv:.4f} <= {self.tv_bound:.4f} over {self.outcomes} outcomes"
        return out + f"; {self.partial_rounds} of {self.rounds} rounds partially accepted"


def default_adapter() -> str:
    names = tiny_adapters()
    if not names:
        raise ConfigError("no registered adapter provides a tiny model")
    return "qwen2_5_vl" if "qwen2_5_vl" in names else names[0]


def sampling_case(
    adapter: str | None = None,
    *,
    draft: str = "self",
    gamma: int = 3,
    keep_ratio: float = 0.5,
    new_tokens: int = 8,
    corrupt: tuple[bool, ...] | None = (True, False, True),
) -> Case:
    """The fixed case the law test samples: the adapter's default prompt (`Prompt.default`)."""
    adapter = adapter or default_adapter()
    model = tiny(adapter)
    unit, words = pixel_unit(model), text_ids(model)
    return Case(
        adapter=adapter,
        grid=(2, 2 * unit, 2 * unit),
        before=words[10:13],
        after=words[20:22],
        draft=draft,
        gamma=gamma,
        keep_ratio=keep_ratio,
        max_new_tokens=new_tokens,
        wrong=corrupt,
        executor="inline",
    )


def _step_stats(p: torch.Tensor, x: int) -> tuple[float, float, float]:  # p [V] float64
    """(p(x), -log p(x) - H(p), Var_p(log p))."""
    support = p > 0
    logp = torch.where(support, p.log(), torch.zeros_like(p))
    H = -float((p * logp).sum())
    var = float((p * logp * logp).sum()) - H * H
    px = float(p[x])
    return px, (-math.log(px) - H) if px > 0 else math.inf, max(var, 0.0)


def assert_sampling_exact(
    build: Callable[[Case], Any],
    *,
    adapter: str | None = None,
    draft: str = "self",
    gamma: int = 3,
    keep_ratio: float = 0.5,
    corrupt: tuple[bool, ...] | None = (True, False, True),
    temperature: float = 0.05,
    top_k: int | None = None,
    new_tokens: int = 8,
    runs: int | None = None,
    max_runs: int = 600,
    sensitivity: float | None = 0.1,
    delta: float = 1e-3,
    require_partial: bool = True,
    seed: int = 0,
) -> SamplingResult:
    """Check that `build(case)`'s pipeline samples exactly the target's law.

    The case is fixed (`sampling_case`): the adapter's tiny target p, drafting for itself
    (`draft="self"`) or with its tiny draft ("draft"), γ, keep ratio, and draft positions replaced
    by q's second choice (`corrupt`) to force partial acceptance. Runs use seeds seed, seed+1, ...
    with do_sample=True, `temperature`, `top_k` (None: no top-k) and `new_tokens`.
    `runs=None` samples until a temperature off by `sensitivity` would be detected (at most
    `max_runs`); `sensitivity=None` only runs `runs`. Raises `LosslessViolation` with a report
    when a test fails, `VacuousCheck` when no round accepted part of its draft or `max_runs` were
    too few to reach `sensitivity`. The defaults are calibrated: an exact sampler passes with
    probability >= 1 - 2 delta, and a temperature 10% off fails with probability about 0.99.
    """
    if runs is None and sensitivity is None:
        raise ConfigError("assert_sampling_exact: give runs=, sensitivity=, or both")
    z_bound = NormalDist().inv_cdf(1 - delta / 2)
    need = math.inf if sensitivity is None else ((z_bound + NormalDist().inv_cdf(POWER)) / sensitivity) ** 2
    case = sampling_case(
        adapter, draft=draft, gamma=gamma, keep_ratio=keep_ratio, new_tokens=new_tokens, corrupt=corrupt
    )
    target, inputs, L = case.target, case.inputs, case.prompt.length
    ids = inputs["input_ids"]  # [1, L]
    gen = {"do_sample": True, "temperature": temperature, "top_k": top_k or 0, "max_new_tokens": new_tokens}
    proc = warpers(temperature, top_k)
    res = SamplingResult(z_bound=z_bound)
    samples: list[tuple[int, ...]] = []
    key = (case.adapter, case.target_seed, case.grid, case.before, case.after, case.video_seed)
    paths = _PATHS.setdefault(key, {})  # raw logits along sampled paths, shared across checks
    total_d = 0.0
    limit = runs if runs is not None else max_runs

    def report(summary: str, details: str = "") -> Report:
        return Report(
            check="sampling",
            summary=summary,
            case=case.short() + f", temperature={temperature:g}, top_k={top_k}",
            parts=part_names(pipe),
            reproduce=(
                "assert_sampling_exact(build, adapter="
                f"{case.adapter!r}, draft={draft!r}, gamma={gamma}, keep_ratio={keep_ratio}, "
                f"temperature={temperature}, top_k={top_k}, new_tokens={new_tokens}, runs={res.runs}, "
                f"sensitivity=None, seed={seed})"
            ),
            details=details or res.summary(),
        )

    with corrupting_plugin():
        pipe, owned = make_pipeline(build, case)
        try:
            for run in range(limit):
                out = pipe.generate(inputs, seed=seed + run, **gen)
                toks = tuple(out.sequences[0, L:].cpu().tolist())
                samples.append(toks)
                s = out.stats
                res.rounds += s.rounds
                res.partial_rounds += sum(
                    0 < n < g for n, g in zip(s.accepted_per_round, s.drafted_per_round)
                )
                res.rejected_rounds += sum(n < g for n, g in zip(s.accepted_per_round, s.drafted_per_round))
                if toks not in paths:
                    paths[toks] = path_logits(target, inputs, list(toks))  # [len + 1, V]
                raw = paths[toks]
                for i, x in enumerate(toks):
                    seq = torch.cat([ids, torch.tensor([toks[:i]], dtype=ids.dtype)], dim=1)  # [1, L + i]
                    p = torch.softmax(proc(seq, raw[i][None].double())[0].double(), -1)  # [V]
                    px, d, v = _step_stats(p, x)
                    if px == 0.0:
                        raise LosslessViolation(
                            report(
                                f"run with seed {seed + run} emitted token {x} at position {i}, which the "
                                "target cannot emit there (p = 0)",
                                f"sampled: {list(toks)}",
                            )
                        )
                    total_d += d
                    res.information += v
                    res.tokens += 1
                res.runs = run + 1
                if runs is None and res.information >= need:
                    break
        finally:
            if owned:
                pipe.close()

    res.z = total_d / math.sqrt(res.information) if res.information > 0 else 0.0
    zp = NormalDist().inv_cdf(POWER)
    res.detectable = (z_bound + zp) / math.sqrt(res.information) if res.information > 0 else math.inf
    if top_k and top_k**new_tokens <= MAX_OUTCOMES:
        law_key = (*key, temperature, top_k, new_tokens)
        if law_key not in _LAWS:
            _LAWS[law_key] = exact_law(target, inputs, new_tokens, proc, set(eos_ids(target)))
        law = _LAWS[law_key]
        res.outcomes = len(law)
        res.tv, res.tv_bound = total_variation(law, samples), tv_threshold(len(law), len(samples), delta)
    if abs(res.z) > z_bound:
        hot = "hot (too random)" if res.z > 0 else "cold (too sure)"
        raise LosslessViolation(
            report(f"the sampled tokens are {hot}: surprisal Z = {res.z:+.2f}, |Z| must be <= {z_bound:.2f}")
        )
    if res.tv is not None and res.tv > res.tv_bound:
        raise LosslessViolation(
            report(
                f"the sequences' law is off: TV {res.tv:.4f} > {res.tv_bound:.4f} ({res.outcomes} outcomes)"
            )
        )
    drafts = getattr(pipe, "draft_adapter", None) is not None
    if require_partial and drafts and not res.partial_rounds:
        raise VacuousCheck(f"no round accepted part of its draft tokens: {res.summary()}")
    if runs is None and sensitivity is not None and res.information < need:
        raise VacuousCheck(
            f"{res.runs} runs (max_runs) detect only a temperature off by {100 * res.detectable:.1f}%, not "
            f"{100 * sensitivity:.0f}%: raise max_runs, lower the temperature, or pass sensitivity=None"
        )
    return res


__all__ = ["Prompt", "SamplingResult", "assert_sampling_exact", "default_adapter", "sampling_case"]
