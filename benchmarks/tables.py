"""Markdown tables for the benchmark reports."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """The lines of a Markdown table: the header, its rule, one line per row.

    `align`: one letter per column, "l" (the default) or "r". A row shorter than the header is padded
    with empty cells, so a run that failed is its name and its error.
    """
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align.ljust(len(header), "l")) + "|"
    return [_line(header), rule, *(_line([*r, *[""] * (len(header) - len(r))]) for r in rows)]


def _line(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"
