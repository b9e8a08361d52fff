"""Stragglers: a rank x time heat map of each rank's lowest section score, and the
verdicts the profiler recorded (syncless.profile.stragglers; docs/stragglers.md)."""

from __future__ import annotations

import html

import numpy as np

from syncless.report.page_parts import Section, f4, figure, table
from syncless.report.stragglers import placed, read_store
from syncless.run.store import RunStore

__all__ = ["MAX_COLUMNS", "sections"]

# Report columns in the heat map at most: more reports are put together (lowest score).
MAX_COLUMNS = 200
_SCORE = r"^profile/(.+)/straggler_score$"


def sections(store: RunStore) -> list[Section]:
    """The stragglers section, or none for a run without straggler scores."""
    grid = _grid(store)
    if grid is None:
        return []
    ranks, steps, low, worst = grid
    verdicts = read_store(store)
    if store.path is not None:  # one run: where its named ranks ran
        verdicts = placed(verdicts, store.path)
    body = (
        '<p class="note">Each cell: the rank\'s lowest section score in that report '
        "(fleet median time over its own, over the profiler's sliding window; 1 is the "
        "fleet, 0.5 twice as slow). Hover for the section.</p>"
    )
    if verdicts:
        worst_v = verdicts[0]
        body += (
            f'<p class="worst" id="worst-straggler">slowest: rank {worst_v.rank} in '
            f"{html.escape(worst_v.section)}, score {worst_v.score:.2f}, steps "
            f"{worst_v.first_step} to {worst_v.last_step}</p>"
        )
    else:
        body += '<p class="note">No rank was named slow in any section.</p>'
    body += _heatmap(ranks, steps, low, worst)
    if verdicts:
        rows = [(v.rank, v.section, v.score, v.first_step, v.last_step,
                 "-" if v.clock_mhz is None else f"{v.clock_mhz:.0f}",
                 "-" if v.place is None else v.place.describe()) for v in verdicts]  # fmt: skip
        body += "<h3>Verdicts</h3>" + table(
            ["rank", "section", "score", "first step", "last step", "SM clock MHz", "where"], rows
        )
    return [Section("stragglers", "Stragglers", body)]


def _grid(store: RunStore) -> tuple[np.ndarray, np.ndarray, np.ndarray, list] | None:
    """(ranks, column steps, lowest score (ranks x columns), its section per cell)."""
    (first, last) = store.sql(
        f"SELECT min(step), max(step) FROM metrics WHERE starts_with(name, 'profile/') "
        f"AND regexp_matches(name, '{_SCORE}')"
    ).fetchall()[0]
    if first is None:
        return None
    reports = store.sql(
        f"SELECT count(DISTINCT step) FROM metrics WHERE starts_with(name, 'profile/') "
        f"AND regexp_matches(name, '{_SCORE}')"
    ).fetchall()[0][0]
    span = max(int(last) - int(first) + 1, 1)
    bucket = 1 if reports <= MAX_COLUMNS else -(-span // MAX_COLUMNS)
    rows = store.sql(
        f"SELECT rank, max(step), min(value), arg_min(regexp_extract(name, '{_SCORE}', 1), value)"
        f" FROM metrics WHERE starts_with(name, 'profile/') AND regexp_matches(name, '{_SCORE}')"
        f" GROUP BY rank, (step - {int(first)}) // {bucket}"
    ).fetchall()
    ranks = np.array(sorted({int(r[0]) for r in rows}))
    steps = np.array(sorted({int(r[1]) for r in rows}))
    low = np.full((len(ranks), len(steps)), np.nan)
    worst = [[""] * len(steps) for _ in ranks]
    r_index = {r: i for i, r in enumerate(ranks.tolist())}
    for rank, step, value, section in rows:
        # A bucket's latest step labels it; ranks reporting together share the label.
        i, j = r_index[int(rank)], int(np.searchsorted(steps, int(step)))
        low[i, j], worst[i][j] = value, section
    return ranks, steps, low, worst


def _heatmap(ranks: np.ndarray, steps: np.ndarray, low: np.ndarray, worst: list) -> str:
    import plotly.graph_objects as go

    fig = go.Figure(
        go.Heatmap(
            z=f4(np.clip(low, 0.0, 1.5)),
            x=steps,
            y=ranks,
            text=worst,
            zmin=0.0,
            zmax=1.0,
            colorscale="RdYlGn",
            colorbar={"title": "score"},
            hovertemplate="rank %{y}, step %{x}<br>%{text}: score %{z:.2f}<extra></extra>",
        )
    )
    fig.update_layout(title="Lowest section score per rank and report", xaxis_title="step",
                      yaxis_title="rank")  # fmt: skip
    return figure(fig, "stragglers", height=min(900, 200 + 12 * len(ranks)))
