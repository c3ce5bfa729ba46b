"""`Case`: one drawn test case, plain values only, so its repr is the code that rebuilds it.

Models and prompts are derived from the values (tiny models are cached per process), and
`Case.builder()` turns the case into a `PipelineBuilder` with the drawn γ, keep ratio, corrupted
draft positions and executor timings passed to every part whose Config takes them.
Notation: p = target, q = draft, γ = draft length.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

import hippo
from hippo.testing.drafters import CORRUPTING
from hippo.testing.models import Prompt, flat_draft, options_for, tiny

#: Executors a case can run a parallel schedule's draft on (in this process): "inline" one after the
#: other, "thread" overlapped on a thread, "simulated" on a virtual clock with the case's timings.
EXECUTORS = ("inline", "thread", "simulated")
#: ... and every executor a case may name: "process" runs the draft in its own process (started per
#: pipeline, the first in seconds: ask for it explicitly, `executors=("process",)`).
ALL_EXECUTORS = (*EXECUTORS, "process")
#: dtypes a case's tiny pair may have: float64 (exact), float32 (the packed linear weights are live)
DTYPES = ("float64", "float32")
TIMING_NAMES = ("target_prefill", "target_forward", "draft_prefill", "draft_forward")
#: fixed costs for a scheduler that plans itself: verifying is flat and drafting nearly free, so it
#: drafts (its switches to the target alone are tested with their own costs in test_planner.py)
DRAFTING_PAYS = {"verify": {1: 1e-3, 17: 1e-3}, "draft": 1e-6}
#: and for `auto`'s keep-ratio planner, a draft step that grows with the tokens it attends to, so
#: that pruning pays and the planner tries smaller keep ratios from job to job
PRUNING_PAYS = ((0, 1e-5), (1000, 1e-3))
_PROMPTS: dict[tuple, Prompt] = {}


def _tuple(value: Any) -> tuple:
    return tuple(value)


def _wrong(value: Any) -> tuple[bool, ...] | None:
    return None if value is None else tuple(bool(v) for v in value)


@attrs.frozen(eq=True)
class Case:
    """The values hypothesis drew for one example; everything else is derived from them."""

    adapter: str
    grid: tuple[int, int, int] = attrs.field(converter=_tuple)  # (T, H, W) of the video, in pixels
    before: tuple[int, ...] = attrs.field(default=(), converter=_tuple)  # text ids before the video
    after: tuple[int, ...] = attrs.field(default=(), converter=_tuple)  # text ids after the video
    video_seed: int = 0
    target_seed: int = 0
    #: "draft": the adapter's tiny draft model; "self": the target drafts for itself; "flat": the
    #: target with its logits halved (`models.flat_draft`: q flatter than p, so drafts are often rejected)
    draft: str = "draft"
    draft_seed: int = 1
    gamma: int | str = 4  # γ, or "auto" (the cost model's γ, hippo.cost)
    keep_ratio: float = 0.5
    selector_seed: int | None = None
    max_new_tokens: int = 8
    min_new_tokens: int | None = None
    eos_pick: int | None = None  # a token the reference emits mid-way becomes a stop token (eos_stop)
    seed: int = 0  # the run's seed (pipeline.generate(seed=...))
    wrong: tuple[bool, ...] | None = attrs.field(default=None, converter=_wrong)  # corrupted draft positions
    executor: str = "inline"  # one of EXECUTORS, for schedulers that take an executor
    timing: tuple[float, float, float, float] = attrs.field(default=(10.0, 4.0, 2.0, 1.0), converter=_tuple)
    extra: dict = attrs.field(factory=dict)  # values drawn from `assert_greedy_lossless(draws=...)`
    dtype: str = "float64"  # one of DTYPES: the tiny pair's dtype

    # ---- derived ------------------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def exact(self) -> bool:
        """Whether greedy equality with `target.generate` is exact (float64), not up to float ties."""
        return self.torch_dtype == torch.float64

    @property
    def target(self) -> Any:
        """The tiny target p (float64 unless the case says float32)."""
        return tiny(self.adapter, "target", self.target_seed, self.torch_dtype)

    @property
    def draft_model(self) -> Any:
        """The draft q: the adapter's tiny draft, the target itself (self-speculation), or the
        target with flattened logits ("flat")."""
        if self.draft == "self":
            return self.target
        if self.draft == "flat":
            return flat_draft(self.adapter, self.target_seed, self.torch_dtype)
        return tiny(self.adapter, "draft", self.draft_seed, self.torch_dtype)

    @property
    def prompt(self) -> Prompt:
        key = (
            self.adapter,
            self.dtype,
            self.target_seed,
            self.grid,
            self.video_seed,
            self.before,
            self.after,
        )
        if key not in _PROMPTS:
            _PROMPTS.clear()  # one prompt at a time: a case is used for one example
            _PROMPTS[key] = Prompt(
                self.adapter, self.target, self.grid, self.video_seed, self.before, self.after
            )
        return _PROMPTS[key]

    @property
    def inputs(self) -> dict:
        return self.prompt.inputs

    def generation(self) -> dict[str, Any]:
        """The greedy decode settings (before `eos_pick` adds a stop token)."""
        gen: dict[str, Any] = {"do_sample": False, "max_new_tokens": self.max_new_tokens}
        if self.min_new_tokens is not None:
            gen["min_new_tokens"] = self.min_new_tokens
        return gen

    def executor_options(self, executor: str | None = None) -> dict[str, Any]:
        """{"executor": name, "executor_options": {...}} for a scheduler that takes an executor."""
        kind = executor or self.executor
        if kind == "thread":
            return {"executor": "inline", "executor_options": {"overlap": "thread"}}
        if kind == "inline":
            return {"executor": "inline", "executor_options": {"overlap": "off"}}
        if kind == "process":
            return {"executor": "process", "executor_options": {}}
        timing = dict(zip(TIMING_NAMES, self.timing))
        return {"executor": kind, "executor_options": options_for("executors", kind, **timing)}

    def builder(
        self,
        scheduler: str = "serial",
        *,
        selector: str = "uniform",
        scorer: str | None = None,
        drafter: str = "chain",
        verifier: str | None = None,
        executor: str | None = None,
        corrupt: bool = True,
        **scheduler_options: Any,
    ) -> hippo.PipelineBuilder:
        """A PipelineBuilder for this case: the tiny pair, then each part with the case's values.

        γ, the keep ratio, the selector seed and the executor (with the simulated timings) go to
        the parts whose Config takes them; `scheduler_options` go to the scheduler as they are.
        With `corrupt` and drawn `wrong` positions, the drafter is wrapped in the corrupting
        drafter, which replaces those draft tokens by wrong ones to force partial acceptance.
        """
        b = hippo.PipelineBuilder().target(self.target).draft(self.draft_model)
        b.scorer(scorer)
        b.selector(
            selector,
            **options_for("selectors", selector, keep_ratio=self.keep_ratio, seed=self.selector_seed),
        )
        if corrupt and self.wrong is not None and any(self.wrong):
            b.drafter(CORRUPTING, wrong=self.wrong, base=drafter)
        else:
            b.drafter(drafter)
        b.verifier(verifier)
        auto = options_for("schedulers", scheduler, gamma=self.gamma)
        if not auto:  # a scheduler that plans its own γ (`auto`): costs under which drafting pays
            auto = options_for("schedulers", scheduler, costs=DRAFTING_PAYS, draft_steps=PRUNING_PAYS)
        if "executor" in options_for("schedulers", scheduler, executor="x"):
            auto.update(self.executor_options(executor))
        return b.scheduler(scheduler, **{**auto, **scheduler_options})

    def short(self) -> str:
        """The shapes and knobs that matter, on one line."""
        t, h, w = self.grid
        parts = [
            f"adapter={self.adapter}",
            f"video {t}x{h}x{w}",
            f"prompt {self.prompt.length} tokens",
            f"draft={self.draft}",
            f"γ={self.gamma}",
            f"keep_ratio={self.keep_ratio:g}",
            f"max_new_tokens={self.max_new_tokens}",
            f"seed={self.seed}",
        ]
        if self.wrong is not None:
            parts.append(f"corrupted={''.join('x' if w else '.' for w in self.wrong)}")
        if self.min_new_tokens is not None:
            parts.append(f"min_new_tokens={self.min_new_tokens}")
        if self.eos_pick is not None:
            parts.append(f"eos_pick={self.eos_pick} (a generated token made a stop token)")
        if self.executor != "inline":
            parts.append(f"executor={self.executor}")
        if not self.exact:
            parts.append(f"dtype={self.dtype}")
        return ", ".join(parts)
