"""Failure reports a person can act on, and the exception that carries them."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class Report:
    """What went wrong on the (shrunk) counterexample, and how to run it again."""

    check: str  # "greedy" or "sampling"
    summary: str  # one line: what is wrong
    case: str  # the counterexample's shapes and knobs, one line
    parts: dict = attrs.field(factory=dict)  # {kind: name} of the pipeline's parts
    position: int | None = None  # first differing generated position
    got: int | None = None  # the pipeline's token there (None: it emitted none)
    want: int | None = None  # target.generate's token there (None: it stopped)
    got_tokens: list = attrs.field(factory=list)
    want_tokens: list = attrs.field(factory=list)
    reproduce: str = ""  # one line of code that runs the counterexample again
    details: str = ""  # anything else (an exception, statistics)
    counterexample: Any = attrs.field(default=None, repr=False)  # the Case itself (greedy), for replay_greedy

    def format(self) -> str:
        lines = [
            f"hippo.testing: {self.check} check FAILED: {self.summary}",
            f"  counterexample: {self.case}",
        ]
        if self.parts:
            lines.append("  parts: " + ", ".join(f"{k}={v}" for k, v in self.parts.items()))
        if self.position is not None:
            lines.append(
                f"  first difference at generated position {self.position}: "
                f"pipeline {_tok(self.got)}, target.generate {_tok(self.want)}"
            )
            lines.append(f"  pipeline:        {self.got_tokens}")
            lines.append(f"  target.generate: {self.want_tokens}")
        if self.details:
            lines.extend(f"  {line}" for line in self.details.splitlines())
        if self.reproduce:
            lines.append(f"  reproduce: {self.reproduce}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _tok(token: Any) -> str:
    return "emitted nothing" if token is None else f"token {token}"


class LosslessViolation(AssertionError):
    """A pipeline's output is not the target's (greedy) or not its law (sampling)."""

    def __init__(self, report: Report, result: Any = None):
        super().__init__(report.format())
        self.report = report
        #: the law check's `SamplingResult` when a law check failed (runs, looks taken), else None
        self.result = result


class VacuousCheck(AssertionError):
    """The check could not have failed: no round ever accepted some but not all of its draft."""
