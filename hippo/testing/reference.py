"""The ground truth: the target's own `generate()`, its raw logits along a path, its exact laws.

Notation: p = target, q = draft, γ = draft length, V = vocabulary size, L = prompt length.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import hippo
from hippo.errors import ConfigError, UnsupportedError
from hippo.testing.models import Prompt, eos_ids, options_for, pixel_unit, selector_scorer_pairs, tiny
from hippo.types import GenerateOutput


def reference(model: Any, inputs: dict, **gen: Any) -> torch.Tensor:  # -> [1, L + new]
    """What the target's own `generate()` returns: the ground truth."""
    with torch.inference_mode():
        return model.generate(**inputs, **gen)


def eos_stop(model: Any, inputs: dict, gen: dict, pick: int | None) -> tuple[dict, torch.Tensor]:
    """`gen` and its reference, plus, when `pick` is given, a stop token the reference emits mid-way.

    The stop token is the reference's generated token number `pick % new`; it joins the model's EOS
    ids, so the reference (and every pipeline) must stop at its first occurrence, which may fall in
    the middle of an accepted draft run.
    """
    ref = reference(model, inputs, **gen)
    if pick is None:
        return gen, ref
    L = inputs["input_ids"].shape[1]
    new = ref[0, L:].tolist()
    if not new:
        return gen, ref
    stop = new[pick % len(new)]
    gen = {**gen, "eos_token_id": [stop, *eos_ids(model)]}
    return gen, reference(model, inputs, **gen)


def build_pipeline(
    target: Any,
    draft: Any = None,
    *,
    scheduler: str = "serial",
    gamma: int = 4,
    selector: str = "uniform",
    keep_ratio: float | None = 0.5,
    scorer: str | None = None,
    selector_seed: int | None = None,
    drafter: str = "chain",
    drafter_options: dict | None = None,
    verifier: str | None = None,
    executor: dict | None = None,  # {"executor": name, "executor_options": {...}} for parallel schedulers
) -> hippo.Pipeline:
    """A pipeline from registry names; options are passed only to parts whose Config has them."""
    b = hippo.PipelineBuilder().target(target)
    if draft is not None:
        b.draft(draft)
    return (
        b.scorer(scorer)
        .selector(selector, **options_for("selectors", selector, keep_ratio=keep_ratio, seed=selector_seed))
        .drafter(drafter, **(drafter_options or {}))
        .verifier(verifier)
        .scheduler(scheduler, **options_for("schedulers", scheduler, gamma=gamma, **(executor or {})))
        .build()
    )


def new_tokens(seq: torch.Tensor, prompt_length: int) -> list[int]:  # seq [1, L + new]
    return seq[0, prompt_length:].tolist()


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where two token lists differ (a missing token counts), or None."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def partial_rounds(out: GenerateOutput) -> list[tuple[int, int]]:
    """(accepted, drafted) of the rounds where some but not all draft tokens were accepted."""
    s = out.stats
    return [(n, g) for n, g in zip(s.accepted_per_round, s.drafted_per_round) if 0 < n < g]


def partial_drafts(stats: Any) -> int:  # stats: hippo.types.Stats
    """Draftings accepted in part: some of a drafting's tokens accepted and some not, whatever the
    rounds were booked as (the vacuity guard of the law check).

    A serial round is one drafting: this counts its rounds with 0 < accepted < drafted (a tree round:
    drafted = its nodes, so a tree whose siblings were left counts too). The parallel schedules
    (`pearl`, `hippo`) verify one drafting in chunks, each booked as a round: x_1 alone, then
    x_2..x_γ (conservative), or a batch whose first token the previous chunk's p_γ checks
    (optimistic). A chunk accepted whole that emitted no token of the target's own (no bonus)
    continues into the next, so "x_1 accepted, then x_2 rejected" counts, though no single round
    accepted part of its tokens (with γ = 2, pearl's first chunks hold one token each).
    """
    n, run = 0, 0
    for accepted, drafted, emitted, rejected in zip(
        stats.accepted_per_round, stats.drafted_per_round, stats.emitted_per_round, stats.rejected_per_round
    ):
        run += accepted
        if rejected or accepted < drafted:  # the drafting ends here, some of it not accepted
            n += run > 0
            run = 0
        elif emitted != accepted:  # accepted whole, then a bonus token: the drafting ends
            run = 0
    return n


# ---- exact laws ----------------------------------------------------------------------------------


class _Force:
    """A logits processor that makes `generate` emit the given tokens, in order."""

    def __init__(self, prompt_length: int, tokens: list[int]):
        self.prompt_length, self.tokens = prompt_length, tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # [1, V]
        step = input_ids.shape[1] - self.prompt_length
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.tokens[step]] = 0.0
        return forced


def path_logits(model: Any, inputs: dict, tokens: list[int]) -> torch.Tensor:  # -> [len(tokens) + 1, V]
    """The raw logits `generate` computes after the prompt and each prefix of `tokens` (one call).

    Row i is what p scores after tokens[:i]. Going through `generate` keeps its positions, cache and
    dtype handling, whatever the backbone, and works for any token, vision placeholders included.
    """
    from transformers import LogitsProcessorList

    L = inputs["input_ids"].shape[1]
    out = reference(
        model,
        inputs,
        do_sample=False,
        max_new_tokens=len(tokens) + 1,
        logits_processor=LogitsProcessorList([_Force(L, [*tokens, 0])]),
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=[],
    )
    return torch.stack([row[0] for row in out.logits])


def next_logits(model: Any, inputs: dict, tokens: list[int]) -> torch.Tensor:  # -> [V] raw logits
    """The raw logits `generate` computes after the prompt and `tokens`."""
    return path_logits(model, inputs, tokens)[len(tokens)]


def warpers(
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
) -> Any:
    """The logits processors `generate` builds for these sampling settings, in its order (the
    repetition penalty first, then the warpers)."""
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    out = LogitsProcessorList()
    if repetition_penalty is not None and repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    return out


def exact_law(
    model: Any,
    inputs: dict,
    n_tokens: int,
    processors: Any,  # transformers LogitsProcessorList: the warpers `generate` applies
    eos: set[int],
    limit: int | None = None,
) -> dict[tuple[int, ...], float]:
    """P(first generated tokens = t) for every t with positive probability, by enumeration.

    A sequence ends after n_tokens or at its first EOS. Each step is the target's own forward pass,
    processed and softmaxed exactly as sampling in `generate` does. With `limit`, raises ConfigError
    as soon as more than `limit` sequences have positive probability (truncate with top_k/top_p).
    """
    ids = inputs["input_ids"]
    law: dict[tuple[int, ...], float] = {}

    def walk(tokens: list[int], prob: float) -> None:
        if len(tokens) == n_tokens or (tokens and tokens[-1] in eos):
            law[tuple(tokens)] = prob
            if limit is not None and len(law) > limit:
                raise ConfigError(
                    f"the target's law of {n_tokens} tokens has more than {limit} outcomes: too many to "
                    "enumerate; sample with a smaller top_k or top_p, or fewer new tokens"
                )
            return
        seq = torch.cat([ids, torch.tensor([tokens], dtype=ids.dtype)], dim=1)  # [1, L + k]
        scores = processors(seq, next_logits(model, inputs, tokens)[None].double())  # [1, V]
        p = torch.softmax(scores[0].double(), dim=-1)  # [V]
        for t in p.nonzero().flatten().tolist():
            walk([*tokens, t], prob * float(p[t]))

    walk([], 1.0)
    return law


def total_variation(law: dict[tuple[int, ...], float], samples: list[tuple[int, ...]]) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    keys = set(law) | set(counts)
    return 0.5 * sum(abs(counts.get(k, 0) / n - law.get(k, 0.0)) for k in keys)


def tv_threshold(k: int, n: int, delta: float = 1e-3) -> float:
    """A bound that n samples from a k-outcome law exceed in total variation with probability <= delta.

    E[TV] = 1/2 sum_j E|p^_j - p_j| <= 1/2 sum_j sqrt(p_j (1 - p_j) / n) <= 1/2 sqrt(k / n)
    (Jensen, then Cauchy-Schwarz). TV changes by at most 1/n when one sample changes, so McDiarmid
    gives P(TV >= E[TV] + t) <= exp(-2 n t^2); t = sqrt(ln(1/delta) / (2n)).
    Seeds are fixed, so a test is deterministic; delta is the chance that a correct sampler fails
    it for a given seed set. (k=16, n=600: 0.082 + 0.076 = 0.16.)
    """
    return 0.5 * math.sqrt(k / n) + math.sqrt(math.log(1 / delta) / (2 * n))


def assert_same(out: GenerateOutput, ref: torch.Tensor, prompt_length: int) -> None:  # ref [1, L + new]
    """The pipeline's output is target.generate's, token for token (a plain assertion)."""
    got, want = new_tokens(out.sequences, prompt_length), new_tokens(ref, prompt_length)
    assert got == want, f"pipeline {got} != target.generate {want} (stats: {out.stats.as_dict()})"
    assert torch.equal(out.sequences.cpu(), ref.cpu())


# ---- combinations an adapter refuses -------------------------------------------------------------

_REFUSED: dict[tuple[str, str, str | None], str | None] = {}


def unsupported(adapter: str, selector: str, scorer: str | None) -> str | None:
    """Why `adapter` refuses this selector/scorer pair (its UnsupportedError), or None if it runs.

    Some parts cannot work with some backbones (e.g. an attention scorer needs attention hooks the
    adapter may lack); hippo refuses those loudly, which is allowed, so they are not lossless cases.
    """
    key = (adapter, selector, scorer)
    if key not in _REFUSED:
        model = tiny(adapter)
        unit = pixel_unit(model)
        prompt = Prompt(adapter, model, (2, 2 * unit, 2 * unit), 0, [], [])
        pipe = build_pipeline(model, model, selector=selector, scorer=scorer, gamma=1)
        try:
            pipe.generate(prompt.inputs, max_new_tokens=2, do_sample=False)
            _REFUSED[key] = None
        except UnsupportedError as exc:
            _REFUSED[key] = str(exc)
    return _REFUSED[key]


def supported_pairs(adapter: str) -> list[tuple[str, str | None]]:
    """`selector_scorer_pairs()` without the pairs `adapter` refuses (see `unsupported`)."""
    return [(sel, sc) for sel, sc in selector_scorer_pairs() if unsupported(adapter, sel, sc) is None]
