"""The parts a report section is made of: a :class:`Section`, figures and tables.

The section modules (``report/sections_*.py``) build their sections from these, and
``report/html.py`` puts the sections on the page.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import plotly.graph_objects as go

__all__ = ["Section", "figure", "table"]


class Section(NamedTuple):
    """One part of the page: an anchor id, a heading and its HTML body."""

    anchor: str
    title: str
    body: str


def figure(fig: go.Figure, anchor: str, height: int = 340) -> str:
    """A figure as a div and its script; plotly.js itself is inlined once by ``page``."""
    fig.update_layout(height=height, margin={"l": 60, "r": 20, "t": 40, "b": 40})
    config = {"displaylogo": False, "responsive": True}
    body = fig.to_html(
        full_html=False, include_plotlyjs=False, div_id=f"fig-{anchor}", config=config
    )
    return f'<div class="chart">{body}</div>'


def table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    """An HTML table; numbers are right-aligned and printed with 4 significant digits."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"<td>{html.escape(str(value))}</td>"
    return (
        f'<td class="n">{value:.4g}</td>'
        if isinstance(value, float)
        else (f'<td class="n">{value:,}</td>')
    )
