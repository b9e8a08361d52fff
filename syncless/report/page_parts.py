"""The parts a report section is made of: a :class:`Section`, figures and tables.

The section modules (``report/sections_*.py``) build their sections from these, and
``report/html.py`` puts the sections on the page.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from syncless.report.bands import Series

__all__ = ["Section", "band", "f4", "figure", "table"]


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


def band(fig: go.Figure, s: Series, name: str, color: str, **where: Any) -> None:
    """A series as its mean line and, where it has a width, its min/max band (the band
    holds every point of a bucket: report/bands.py). ``where``: ``row``, ``col`` of a
    subplot."""
    if np.any(s.high > s.low):
        edge = {"width": 0, "color": color}
        fig.add_scatter(x=s.steps, y=f4(s.low), mode="lines", line=edge, legendgroup=name,
                        showlegend=False, hoverinfo="skip", **where)  # fmt: skip
        fig.add_scatter(x=s.steps, y=f4(s.high), mode="lines", line=edge, fill="tonexty",
                        fillcolor=_alpha(color, 0.2), legendgroup=name, showlegend=False,
                        hoverinfo="skip", **where)  # fmt: skip
    fig.add_scatter(x=s.steps, y=f4(s.mean), mode="lines", name=name, legendgroup=name,
                    line={"color": color, "width": 1.5}, **where)  # fmt: skip


def f4(values: np.ndarray) -> np.ndarray:
    """float32: half the bytes in the page, and 7 digits are more than a chart shows."""
    return np.asarray(values, dtype=np.float32)


def _alpha(color: str, alpha: float) -> str:
    color = color.lstrip("#")
    red, green, blue = (int(color[i : i + 2], 16) for i in (0, 2, 4))
    return f"rgba({red}, {green}, {blue}, {alpha})"


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
