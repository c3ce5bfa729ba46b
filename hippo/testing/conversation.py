"""`assert_conversation_lossless`: questions answered from a cached video context equal `target.generate`.

A drawn `Case` gives the video, the text before it and the first question (its text after the
video); hypothesis adds up to three more questions and whether they continue one conversation
(each prompt holds the earlier questions and answers) or are asked independently. Each answer must
equal `target.generate` on that turn's whole prompt, built from scratch by the adapter's
`synthetic_inputs`; afterwards the context's cached prefix must be exactly as prepared.
Notation: p = target, q = draft, P = cached prefix length.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from hippo.testing._deps import require_hypothesis

require_hypothesis()

from hypothesis import example, given  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hippo.testing.case import EXECUTORS, Case  # noqa: E402
from hippo.testing.drafters import corrupting_plugin  # noqa: E402
from hippo.testing.greedy import (  # noqa: E402
    fixed_extra,
    hypothesis_settings,
    make_pipeline,
    part_names,
    regression_cases,
)
from hippo.testing.models import Prompt, special_ids, text_ids  # noqa: E402
from hippo.testing.reference import eos_stop, first_difference, new_tokens, partial_rounds  # noqa: E402
from hippo.testing.report import LosslessViolation, Report, VacuousCheck  # noqa: E402
from hippo.testing.strategies import _adapters, cases  # noqa: E402

#: more questions after the case's own: each a list of word picks (indices into the text ids)
more_questions = st.lists(st.lists(st.integers(0, 10**6), max_size=4), max_size=3)


def snapshot(ctx: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A copy of the context's cached KV, to check that no question changed it."""
    return [(layer.keys.clone(), layer.values.clone()) for layer in ctx.cache.layers]


def unchanged(ctx: Any, snap: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    layers = ctx.cache.layers
    return len(layers) == len(snap) and all(
        torch.equal(k, layer.keys) and torch.equal(v, layer.values) for (k, v), layer in zip(snap, layers)
    )


def run_conversation(
    build: Callable[[Case], Any],
    case: Case,
    questions: Sequence[Sequence[int]] = (),
    independent: bool = False,
) -> list[Any]:
    """Prepare the case's video once, ask its question then `questions`; compare every answer."""
    target, words = case.target, text_ids(case.target)
    special = special_ids(target)
    asked = [list(case.after), *([words[i % len(words)] for i in q] for q in questions)]
    pipe, owned = make_pipeline(build, case)
    outs = []

    def fail(summary: str, turn: int, got: list[int] | None = None, want: list[int] | None = None) -> None:
        pos = None if got is None else first_difference(got, want)
        raise LosslessViolation(
            Report(
                check="conversation",
                summary=f"turn {turn + 1} of {len(asked)} ({'independent' if independent else 'conversation'}): "
                + summary,
                case=case.short(),
                parts=part_names(pipe),
                position=pos,
                got=None if got is None or pos is None or pos >= len(got) else got[pos],
                want=None if want is None or pos is None or pos >= len(want) else want[pos],
                got_tokens=got or [],
                want_tokens=want or [],
                reproduce="from hippo.testing.conversation import run_conversation; "
                f"run_conversation(build, {case!r}, {[list(q) for q in questions]!r}, {independent})",
                counterexample=case,
            )
        )

    try:
        ctx = pipe.prepare(case.inputs)
        conv = pipe.conversation(ctx)
        snap = snapshot(ctx)
        history: list[int] = []  # the earlier questions and answers (conversation mode)
        done = ctx.length  # tokens of the conversation so far (prefix, earlier questions and answers)
        for turn, question in enumerate(asked):
            prompt = Prompt(case.adapter, target, case.grid, case.video_seed, case.before, history + question)
            gen, ref = eos_stop(target, prompt.inputs, case.generation(), case.eos_pick)
            ids = prompt.inputs["input_ids"][0]  # [L] the turn's whole prompt, built from scratch
            if independent:
                out = pipe.ask(ctx, ids[ctx.length :], seed=case.seed, **gen)
            else:
                out = conv.ask(ids[done:], seed=case.seed, **gen)
            outs.append(out)
            got, want = new_tokens(out.sequences, prompt.length), new_tokens(ref, prompt.length)
            if got != want or not torch.equal(out.sequences.cpu(), ref.cpu()):
                fail("the answer is not target.generate's on the whole prompt", turn, got, want)
            if independent:
                continue
            history, done = history + question + got, int(out.sequences.shape[1])
            if special & set(got):  # an answer holding a placeholder id cannot be re-fed as text
                break
        if not unchanged(ctx, snap):
            fail("the context's cached prefix KV changed", len(asked) - 1)
        ctx.close()
    finally:
        if owned:
            pipe.close()
    return outs


def assert_conversation_lossless(
    build: Callable[[Case], Any],
    *,
    adapters: Sequence[str] | str | None = None,
    examples: int | None = None,
    seed: int | None = None,
    self_draft: bool | None = None,
    executors: Sequence[str] = EXECUTORS,
    draws: dict[str, st.SearchStrategy] | None = None,
    require_partial: bool = True,
) -> int:
    """Check `build(case)`'s pipeline on video contexts: 1-4 questions per drawn case, answered as a
    conversation or independently, each equal to `target.generate` on its whole prompt. `draws`
    go to `case.extra` (e.g. the scheduler). The greedy check's `regression_cases` run first (two
    questions, as a conversation), with each draw's first value. Raises `LosslessViolation`, or
    `VacuousCheck` (with `require_partial`) when answers were drafted but no round accepted some
    but not all of its draft tokens; returns the examples run."""
    ran = [0]
    partial, drafted = [0], [False]
    strategy = cases(
        adapters,
        corrupt=True,
        self_draft=self_draft,
        executors=executors,
        draws={"questions": more_questions, "independent": st.booleans(), **(draws or {})},
    )

    def lossless(case: Case) -> None:
        outs = run_conversation(build, case, case.extra["questions"], case.extra["independent"])
        ran[0] += 1
        partial[0] += sum(len(partial_rounds(out)) for out in outs)
        drafted[0] = drafted[0] or any(out.stats.rounds for out in outs)

    where = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    lossless._hypothesis_internal_add_digest = f"{where}|conversation|{_adapters(adapters)}".encode()
    lossless = hypothesis_settings(examples, seed)(given(case=strategy)(lossless))
    extra = fixed_extra(draws)
    if self_draft is not False and extra is not None:
        extra = {"questions": [[1, 2, 3]], "independent": False, **extra}
        for case in reversed(regression_cases(_adapters(adapters)[0], executors[0])):
            lossless = example(case=attrs.evolve(case, extra=extra))(lossless)
    if seed is not None:
        lossless = hypothesis_seed(seed)(lossless)
    with corrupting_plugin():
        lossless()
    if require_partial and drafted[0] and not partial[0]:
        raise VacuousCheck(
            f"no round accepted some but not all of its draft tokens over {ran[0]} conversations: "
            "build with case.builder(...) (it corrupts drawn draft positions), use more examples, or "
            "pass require_partial=False"
        )
    return ran[0]
