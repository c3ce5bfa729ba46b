"""Hypothesis strategies: videos, prompts, decode settings, γ, keep ratios, corruption, timings, cases.

Notation: p = target, q = draft, γ = draft length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hippo.testing._deps import require_hypothesis

require_hypothesis()

from hypothesis import strategies as st  # noqa: E402

from hippo.errors import ConfigError  # noqa: E402
from hippo.testing.case import ALL_EXECUTORS, DTYPES, EXECUTORS, Case  # noqa: E402
from hippo.testing.models import Prompt, eos_ids, pixel_unit, text_ids, tiny, tiny_adapters  # noqa: E402
from hippo.testing.options import default_examples  # noqa: E402

frames = st.integers(1, 6)
pixel_multiples = st.integers(1, 4)  # H and W are 1..4 times the adapter's pixel unit (28 for Qwen2.5-VL)
gammas = st.integers(1, 8)
#: γ fixed per case, or "auto" (the cost model chooses γ round by round)
gammas_or_auto = gammas | st.just("auto")
keep_ratios = st.floats(0.05, 1.0, allow_nan=False)
max_new_tokens = st.integers(1, 24)
seeds = st.integers(0, 2**31 - 1)
model_seeds = st.integers(0, 2)  # tiny models are cached per seed: keep the set small
eos_picks = st.none() | st.integers(0, 23)
corrupt_patterns = st.lists(st.booleans(), min_size=1, max_size=8).map(tuple)
durations = st.floats(min_value=0.1, max_value=30.0, allow_nan=False)  # virtual seconds
#: (target prefill, target forward, draft prefill, draft forward) for the simulated executor
timings = st.tuples(durations, durations, durations, durations)


def examples(weight: float) -> int:
    """max_examples for one test: `weight` times `--hippo-examples` if given, else times the active
    hypothesis profile's max_examples."""
    return max(1, round(default_examples() * weight))


def law_runs() -> int:
    """Seeded pipeline runs for a sampling smoke run: 10 per example (150 with the ci profile).

    Not the runs of a law check: `assert_sampling_exact` and `LawCheck` pick N for their stated power
    (>= 0.95 against any total-variation error of 0.05, `hippo.testing.power`), and refuse an explicit
    `runs` below it unless `require_power=False`. Kept for callers that sample without a law check.
    """
    return 10 * examples(1.0)


def grids(model: Any) -> st.SearchStrategy[tuple[int, int, int]]:  # (T, H, W) in pixels
    unit = pixel_unit(model)
    side = pixel_multiples.map(lambda k: k * unit)
    return st.tuples(frames, side, side)


def text(model: Any, max_size: int = 6, with_eos: bool = False) -> st.SearchStrategy[list[int]]:
    """Lists of text ids; EOS may appear (without stopping anything) only when asked for."""
    pool = text_ids(model) + (eos_ids(model) if with_eos else [])
    return st.lists(st.sampled_from(pool), max_size=max_size)


@st.composite
def prompts(draw, adapter: str, model: Any, with_eos: bool = False) -> Prompt:
    grid = draw(grids(model), label="grid (T, H, W)")
    return Prompt(
        adapter,
        model,
        grid,
        draw(seeds, label="video seed"),
        draw(text(model, with_eos=with_eos), label="text before"),
        draw(text(model, with_eos=with_eos), label="text after"),
    )


def _adapters(adapters: Sequence[str] | str | None) -> list[str]:
    if isinstance(adapters, str):
        adapters = [adapters]
    names = list(adapters) if adapters is not None else tiny_adapters()
    available = tiny_adapters()
    missing = [a for a in names if a not in available]
    if missing or not names:
        raise ConfigError(
            f"no tiny model for adapter(s) {', '.join(missing) or '(none given)'}; adapters with one: "
            f"{', '.join(available) or 'none'} (an adapter provides one through its `tiny_module`)"
        )
    return names


def pairs(adapters: Sequence[str] | str | None = None) -> st.SearchStrategy[tuple[str, Any, Any]]:
    """(adapter, target p, draft q): tiny float64 pairs of `adapters` (default: every adapter with a
    tiny model, a third party's included)."""
    names = _adapters(adapters)

    @st.composite
    def build(draw) -> tuple[str, Any, Any]:
        adapter = draw(st.sampled_from(names), label="adapter")
        target = tiny(adapter, "target", draw(model_seeds, label="target seed"))
        return adapter, target, tiny(adapter, "draft", draw(model_seeds, label="draft seed"))

    return build()


def cases(
    adapters: Sequence[str] | str | None = None,
    *,
    corrupt: bool = True,
    self_draft: bool | None = None,
    executors: Sequence[str] = EXECUTORS,
    draws: Mapping[str, st.SearchStrategy] | None = None,
    stops: bool = True,
    seeds_of_models: st.SearchStrategy[int] | None = None,
    gamma: st.SearchStrategy[int | str] | None = None,
    dtypes: Sequence[str] = ("float64",),
) -> st.SearchStrategy[Case]:
    """Whole test cases: a tiny pair of one of `adapters` (default: every adapter with a tiny model),
    a video and prompt (EOS ids in the text sometimes), γ, a keep ratio, a token budget, a
    min_new_tokens, an EOS that stops mid-way, a run seed, corrupted draft positions (with
    `corrupt`), an executor and simulated timings, and `draws` (name -> strategy) into `case.extra`.

    `self_draft`: True always drafts with the target itself, False always with the tiny draft,
    None lets hypothesis choose. `stops=False` draws no min_new_tokens and no mid-way EOS.
    `seeds_of_models` draws the tiny models' seeds (default 0-2; `st.just(0)` keeps one pair, e.g.
    when each new model object costs a compilation). `executors` may include "process" (a draft
    process per pipeline). `gamma` draws γ (default 1-8; `gammas_or_auto` adds "auto"). `dtypes`:
    "float64" (exact) and/or "float32" (the target's packed linear weights are live; see
    `assert_greedy_lossless` for how float32 ties are judged).
    """
    names = _adapters(adapters)
    extra = dict(draws or {})
    model_seed = model_seeds if seeds_of_models is None else seeds_of_models
    bad = [e for e in executors if e not in ALL_EXECUTORS]
    if bad or not executors:
        raise ConfigError(f"executors {bad or list(executors)}: choose among {', '.join(ALL_EXECUTORS)}")
    odd = [d for d in dtypes if d not in DTYPES]
    if odd or not dtypes:
        raise ConfigError(f"dtypes {odd or list(dtypes)}: choose among {', '.join(DTYPES)}")
    gamma_draw = gammas if gamma is None else gamma

    @st.composite
    def build(draw) -> Case:
        adapter = draw(st.sampled_from(names), label="adapter")
        target_seed = draw(model_seed, label="target seed")
        model = tiny(adapter, "target", target_seed)
        roles = ["self", "draft"] if self_draft is None else (["self"] if self_draft else ["draft"])
        with_eos = draw(st.booleans(), label="EOS ids in the prompt")
        max_new = draw(max_new_tokens, label="max_new_tokens")
        return Case(
            adapter=adapter,
            grid=draw(grids(model), label="grid (T, H, W)"),
            before=draw(text(model, with_eos=with_eos), label="text before"),
            after=draw(text(model, with_eos=with_eos), label="text after"),
            video_seed=draw(seeds, label="video seed"),
            target_seed=target_seed,
            draft=draw(st.sampled_from(roles), label="draft"),
            draft_seed=draw(model_seed, label="draft seed"),
            gamma=draw(gamma_draw, label="γ"),
            keep_ratio=draw(keep_ratios, label="keep ratio"),
            selector_seed=draw(st.none() | seeds, label="selector seed"),
            max_new_tokens=max_new,
            min_new_tokens=draw(st.none() | st.integers(1, max_new), label="min_new_tokens")
            if stops
            else None,
            eos_pick=draw(eos_picks, label="EOS pick") if stops else None,
            seed=draw(seeds, label="run seed"),
            wrong=draw(st.none() | corrupt_patterns, label="corrupted positions") if corrupt else None,
            executor=draw(st.sampled_from(list(executors)), label="executor"),
            timing=draw(timings, label="timings"),
            extra={k: draw(v, label=k) for k, v in sorted(extra.items())},
            dtype=draw(st.sampled_from(list(dtypes)), label="dtype"),
        )

    return build()
