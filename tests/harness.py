"""Reusable pieces of the lossless test-suite.

- discovery: adapters, schedulers, selectors and scorers come from the registries, so a backbone or a
  part added later is tested without touching the tests;
- tiny float64 models, cached per process by (adapter, role, seed);
- hypothesis strategies for videos, prompts, γ, keep ratios, token budgets and seeds;
- `reference`: the target's own `generate()`, the ground truth every pipeline must reproduce;
- `CorruptingDrafter`: a test plugin that replaces chosen draft tokens by wrong ones, to force
  partial acceptance (with q rows that say truthfully how each token was drawn);
- `eos_stop`: turns a token the reference emits mid-way into a stop token.

Notation: p = target, q = draft, γ = draft length, V = vocabulary size, L = prompt length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st

import hippo
from hippo.errors import UnsupportedError
from hippo.interfaces import Drafter, ModelSession
from hippo.registry import lookup, registry
from hippo.sampling import TokenPolicy
from hippo.types import DraftProposal, GenerateOutput

DTYPE = torch.float64

# ---- discovery ----------------------------------------------------------------------------------


def names(kind: str) -> list[str]:
    """Registered names of one plugin kind ('adapters', 'schedulers', ...), sorted."""
    return sorted(registry(kind))


def part_class(kind: str, name: str) -> type:
    return lookup(kind, name)


def config_fields(cls: type) -> set[str]:
    config = getattr(cls, "Config", None)
    return {a.name for a in attrs.fields(config)} if config is not None and attrs.has(config) else set()


def options_for(kind: str, name: str, **candidates: Any) -> dict[str, Any]:
    """The candidate options that the part's attrs Config actually has (e.g. keep_ratio, gamma, seed)."""
    fields = config_fields(part_class(kind, name))
    return {k: v for k, v in candidates.items() if k in fields and v is not None}


def executor_choices(scheduler: str) -> list[dict | None]:
    """In-process ways to run a scheduler's draft: None for a scheduler without executors, else
    one after the other, and overlapped on a thread (the CUDA-stream path of `inline`)."""
    if "executor" not in config_fields(part_class("schedulers", scheduler)):
        return [None]
    thread = {"executor": "inline", "executor_options": {"overlap": "thread"}}
    return [{"executor": "inline", "executor_options": {"overlap": "off"}}, thread]


def drafting_schedulers() -> list[str]:
    return [n for n in names("schedulers") if part_class("schedulers", n).needs_draft]


def selector_scorer_pairs(adapter: str | None = None) -> list[tuple[str, str | None]]:
    """Every selector, each scored one paired with every registered scorer.

    With `adapter`, pairs that the adapter refuses with UnsupportedError are left out (see
    `unsupported`; `combination_params` reports them as skips).
    """
    scorers = names("scorers")
    pairs: list[tuple[str, str | None]] = []
    for sel in names("selectors"):
        if part_class("selectors", sel).needs_scores:
            pairs.extend((sel, sc) for sc in scorers)
        else:
            pairs.append((sel, None))
    if adapter is not None:
        pairs = [(sel, sc) for sel, sc in pairs if unsupported(adapter, sel, sc) is None]
    return pairs


# ---- tiny models --------------------------------------------------------------------------------

_MODELS: dict[tuple[str, str, int], Any] = {}


def tiny(adapter: str, role: str = "target", seed: int = 0) -> Any:
    """The adapter's tiny random model in float64, built once per process.

    Raises NotImplementedError for adapters that ship no tiny model (see `tiny_or_skip`).
    """
    key = (adapter, role, seed)
    if key not in _MODELS:
        model = part_class("adapters", adapter).tiny_model(role, seed=seed, dtype=DTYPE)
        _MODELS[key] = model.eval()
    return _MODELS[key]


def tiny_or_skip(adapter: str, role: str = "target", seed: int = 0) -> Any:
    try:
        return tiny(adapter, role, seed)
    except NotImplementedError as exc:
        pytest.skip(f"adapter {adapter!r} has no tiny model: {exc}")


def vocab_size(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _ints(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def eos_ids(model: Any) -> list[int]:
    return _ints(model.generation_config.eos_token_id)


def special_ids(model: Any) -> set[int]:
    """Every id named `*_token_id` in the model's configs: BOS/EOS/pad, vision placeholders..."""
    configs = [model.config, model.generation_config]
    text = getattr(model.config, "get_text_config", None)
    if text is not None:
        configs.append(text())
    out: set[int] = set()
    for cfg in configs:
        for key, value in cfg.to_dict().items():
            if key.endswith("_token_id") or key.endswith("_token_index"):
                out.update(_ints(value))
    return out


def text_ids(model: Any) -> list[int]:
    """Ordinary text tokens: the vocabulary minus every special id."""
    special = special_ids(model)
    return [i for i in range(vocab_size(model)) if i not in special]


# ---- strategies ---------------------------------------------------------------------------------

frames = st.integers(1, 6)
pixel_multiples = st.integers(1, 4)  # H and W are 1..4 times the adapter's pixel unit (28 for Qwen2.5-VL)
gammas = st.integers(1, 8)
keep_ratios = st.floats(0.05, 1.0, allow_nan=False)
max_new_tokens = st.integers(1, 24)
seeds = st.integers(0, 2**31 - 1)
model_seeds = st.integers(0, 2)  # tiny models are cached per seed: keep the set small


def pixel_unit(model: Any) -> int:
    """The side, in pixels, of one visual token before pruning: patch x spatial merge.

    28 for Qwen2.5-VL (14 x 2), 32 for Qwen3-VL (16 x 2); backbones that resize frames accept any
    multiple of their patch size.
    """
    vc = model.config.vision_config
    return int(vc.patch_size) * int(getattr(vc, "spatial_merge_size", 1) or 1)


def grids(model: Any) -> st.SearchStrategy[tuple[int, int, int]]:  # (T, H, W) in pixels
    unit = pixel_unit(model)
    side = pixel_multiples.map(lambda k: k * unit)
    return st.tuples(frames, side, side)


def examples(weight: float) -> int:
    """max_examples for one test: `weight` times the active profile's (see conftest.py)."""
    return max(1, round(settings().max_examples * weight))


def make_video(t: int, h: int, w: int, seed: int) -> torch.Tensor:  # -> [T, H, W, 3] in [0, 1]
    return torch.rand(t, h, w, 3, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


class Prompt:
    """One video between two runs of text ids; `inputs` is the processor-shaped dict."""

    def __init__(self, adapter: str, model: Any, grid: tuple[int, int, int], video_seed: int, before, after):
        self.adapter, self.grid, self.video_seed = adapter, tuple(grid), video_seed
        self.before, self.after = tuple(before), tuple(after)
        video = make_video(*grid, video_seed)  # [T, H, W, 3]
        self.inputs = part_class("adapters", adapter).synthetic_inputs(
            model, video, list(before), list(after)
        )

    @property
    def length(self) -> int:
        return int(self.inputs["input_ids"].shape[1])

    def __repr__(self) -> str:  # hypothesis prints this for a falsifying example: no tensors
        return (
            f"Prompt({self.adapter!r}, grid={self.grid}, video_seed={self.video_seed}, "
            f"before={list(self.before)}, after={list(self.after)}, length={self.length})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


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


# ---- reference and pipelines --------------------------------------------------------------------


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
    stop = new[pick % len(new)]
    gen = {**gen, "eos_token_id": [stop, *eos_ids(model)]}
    return gen, reference(model, inputs, **gen)


def build(
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


def new_tokens(seq: torch.Tensor, prompt_length: int) -> list[int]:
    return seq[0, prompt_length:].tolist()


def assert_same(out: GenerateOutput, ref: torch.Tensor, prompt_length: int) -> None:
    got, want = new_tokens(out.sequences, prompt_length), new_tokens(ref, prompt_length)
    assert got == want, f"pipeline {got} != target.generate {want} (stats: {out.stats.as_dict()})"
    assert torch.equal(out.sequences.cpu(), ref.cpu())


def partial_rounds(out: GenerateOutput) -> list[tuple[int, int]]:
    """(accepted, drafted) of the rounds where some but not all draft tokens were accepted."""
    s = out.stats
    return [(n, g) for n, g in zip(s.accepted_per_round, s.drafted_per_round) if 0 < n < g]


# ---- the corrupting drafter (a test plugin) -----------------------------------------------------

CORRUPTING = "test-corrupting"


def _as_bools(value: Any) -> tuple[bool, ...]:
    return tuple(bool(v) for v in value)


class CorruptingDrafter(Drafter):
    """Runs a registered drafter, then replaces the draft tokens at the chosen positions.

    `wrong[i]` says whether draft position i of each round (0-based) is replaced. The replacement
    must be a deterministic function of what precedes the draw, so that the reported q row is the
    law it was drawn from and the rejection rule stays exact:
    - greedy (no q): w = (x + shift) mod V, never x itself;
    - sampling: w = the token ranked `rank` under q_i (0 = most likely), a function of q_i only,
      not of the sampled x_i; q_i is then reported as one-hot(w).
    Later draft tokens were drafted after the original x_i; any q is allowed there as long as it
    is reported truthfully, so the round stays exact.
    """

    @attrs.frozen
    class Config:
        wrong: tuple[bool, ...] = attrs.field(default=(), converter=_as_bools)
        shift: int = attrs.field(default=1, validator=attrs.validators.ge(1))
        rank: int = attrs.field(default=1, validator=attrs.validators.ge(0))
        base: str = "chain"

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.base = lookup("drafters", self.config.base)()

    def propose(
        self, session: ModelSession, prefix: torch.Tensor, gamma: int, policy: TokenPolicy
    ) -> DraftProposal:
        proposal = self.base.propose(session, prefix, gamma, policy)
        tokens = proposal.tokens.clone()  # [γ]
        q = None if proposal.q is None else proposal.q.clone()  # [γ, V] or None
        vocab = int(session.last_logits.shape[-1])
        for i in range(min(gamma, len(self.config.wrong))):
            if not self.config.wrong[i]:
                continue
            x = int(tokens[i])
            if q is None:
                step = self.config.shift % vocab or 1
                tokens[i] = (x + step) % vocab
            else:
                order = torch.sort(q[i], descending=True, stable=True).indices  # [V]
                w = int(order[self.config.rank % vocab])
                tokens[i] = w
                q[i] = torch.nn.functional.one_hot(torch.tensor(w), q.shape[-1]).to(q.dtype)
        return DraftProposal(tokens=tokens, q=q)


class _CorruptingPlugin:
    """The test plugin object: registers `CorruptingDrafter` as a drafter."""

    @hippo.hookimpl
    def hippo_register_drafters(self) -> dict[str, type]:
        return {CORRUPTING: CorruptingDrafter}


@contextlib.contextmanager
def corrupting_plugin() -> Iterator[str]:
    """Register the corrupting drafter on hippo's plugin manager for the duration of the block."""
    pm = hippo.plugin_manager()
    plugin = _CorruptingPlugin()
    pm.register(plugin, name="hippo-tests-corrupting")
    try:
        yield CORRUPTING
    finally:
        pm.unregister(plugin=plugin)


corrupt_patterns = st.lists(st.booleans(), min_size=1, max_size=8).map(tuple)


def adapter_params() -> list[Any]:
    """Every registered adapter as a pytest param; those without a tiny model are marked skip."""
    out = []
    for name in names("adapters"):
        try:
            tiny(name)
            out.append(pytest.param(name, id=name))
        except NotImplementedError as exc:
            out.append(pytest.param(name, id=name, marks=pytest.mark.skip(reason=f"no tiny model: {exc}")))
    return out


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
        pipe = build(model, model, selector=selector, scorer=scorer, gamma=1)
        try:
            pipe.generate(prompt.inputs, max_new_tokens=2, do_sample=False)
            _REFUSED[key] = None
        except UnsupportedError as exc:
            _REFUSED[key] = str(exc)
    return _REFUSED[key]


def combination_params() -> list[Any]:
    """(adapter, selector, scorer) for every adapter with a tiny model and every pair; refused
    combinations are marked skip with the adapter's reason, so they show up in the report."""
    out = []
    for param in adapter_params():
        (adapter,) = param.values
        for sel, sc in selector_scorer_pairs():
            pid = f"{adapter}-{sel}-{sc}"
            if param.marks:
                out.append(pytest.param(adapter, sel, sc, id=pid, marks=param.marks))
            elif (why := unsupported(adapter, sel, sc)) is not None:
                out.append(pytest.param(adapter, sel, sc, id=pid, marks=pytest.mark.skip(reason=why)))
            else:
                out.append(pytest.param(adapter, sel, sc, id=pid))
    return out


# ---- exact laws for sampling tests --------------------------------------------------------------


class _Force:
    """A logits processor that makes `generate` emit the given tokens, in order."""

    def __init__(self, prompt_length: int, tokens: list[int]):
        self.prompt_length, self.tokens = prompt_length, tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # [1, V]
        step = input_ids.shape[1] - self.prompt_length
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.tokens[step]] = 0.0
        return forced


def next_logits(model: Any, inputs: dict, tokens: list[int]) -> torch.Tensor:  # -> [V] raw logits
    """The raw logits `generate` computes after the prompt and `tokens` (forced, in one generate call).

    Going through `generate` keeps its positions, cache and dtype handling, whatever the backbone,
    and works for any token, vision placeholders included.
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
    return out.logits[len(tokens)][0]


def exact_law(
    model: Any,
    inputs: dict,
    n_tokens: int,
    processors: Any,  # transformers LogitsProcessorList: the warpers `generate` applies
    eos: set[int],
) -> dict[tuple[int, ...], float]:
    """P(first generated tokens = t) for every t with positive probability, by enumeration.

    A sequence ends after n_tokens or at its first EOS. Each step is the target's own forward pass,
    processed and softmaxed exactly as sampling in `generate` does.
    """
    ids = inputs["input_ids"]
    law: dict[tuple[int, ...], float] = {}

    def walk(tokens: list[int], prob: float) -> None:
        if len(tokens) == n_tokens or (tokens and tokens[-1] in eos):
            law[tuple(tokens)] = prob
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
