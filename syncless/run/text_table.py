"""Query results as a box-drawn text table, without a rendering library.

``syncless query`` prints its rows here. rich drew them before, and importing it was
60 ms of a command that should answer at once (issue #48). The look is rich's
default: a heavy header, light rows, numbers right-aligned, a row count below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

__all__ = ["write_table"]


def write_table(columns: Sequence[str], rows: Sequence[Sequence[object]], out: TextIO) -> None:
    """Write ``rows`` under ``columns`` as a table; ``None`` prints as ``NULL``.

    Example::

        write_table(["step", "value"], [(0, 5.5), (1, 5.25)], sys.stdout)
    """
    cells = [[_text(v) for v in row] for row in rows]
    widths = [len(c) for c in columns]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    right = [bool(rows) and all(_is_number(r[i]) for r in rows) for i in range(len(columns))]

    def line(left: str, fill: str, middle: str, end: str) -> str:
        return left + middle.join(fill * (w + 2) for w in widths) + end + "\n"

    def row_text(values: Sequence[str], bar: str) -> str:
        padded = (
            v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right, strict=True)
        )
        return bar + bar.join(f" {p} " for p in padded) + bar + "\n"

    parts = [line("┏", "━", "┳", "┓"), row_text(list(columns), "┃"), line("┡", "━", "╇", "┩")]
    parts += [row_text(row, "│") for row in cells]
    parts.append(line("└", "─", "┴", "┘"))
    parts.append(f"{len(rows)} row(s)\n")
    out.write("".join(parts))


def _text(value: object) -> str:
    # One line per cell: a newline inside a value would break the box.
    return "NULL" if value is None else str(value).replace("\n", "\\n")


def _is_number(value: object) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))
