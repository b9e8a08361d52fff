"""A run directory loaded for the HTML report: one scan for every curve, then numpy.

Every metric is aggregated in DuckDB by step bucket in one scan of the run
(``report/bands.py``): the curves, and the layer x step heatmaps read off the per-layer
metrics' bands. A few narrow queries add the rest: the per-rank profile means, the
head/expert grids at the latest step (only the row groups of that step are read), the
first NaN/Inf, the capture index. A run of a million records loads as a few thousand
rows. Start at :func:`load`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from syncless.report.bands import Grid, Series, read_series
from syncless.report.nonfinite import FirstNonfinite, first_nonfinite
from syncless.run.store import RunStore

__all__ = ["Cells", "RunData", "Series", "layer_cells", "load"]

# Per-layer metrics read into layer x step matrices: the heatmaps of sections_layers
# (its HEATMAPS name these; tests/report/test_html.py keeps the two lists equal).
LAYER_METRICS = (
    "attn_qk_logit_max",
    "attn_entropy_nats",
    "act_absmax",
    "act_rms",
    "act_kurtosis",
    "nonfinite_count",
    "grad_out_rms",
    "grad_out_absmax",
    "grad_out_nonfinite_count",
    "grad_norm",
    "update_ratio",
    "moe_imbalance",
    "moe_tokens_count",
)
LAYER_NAME = re.compile(r"monitors/layer_(\d+)/([^/]+)")
_SUB_NAME = r"^monitors/layer_(\d+)/([^/]+)/(?:head|expert)_(\d+)$"


@dataclass
class Cells:
    """A metric's values on a (row, column) grid, with its min and max over ranks."""

    rows: np.ndarray  # layer (or head/expert) ids
    columns: np.ndarray  # steps (or layer ids)
    low: np.ndarray  # shape (rows, columns); NaN where nothing was recorded
    high: np.ndarray
    step: int | None = None  # for head/expert grids: the step they show


@dataclass
class RunData:
    """What the report sections read. ``series`` holds every metric that is not per
    layer; ``layers`` the per-layer matrices; ``subs`` the head/expert x layer grids."""

    info: dict[str, Any]
    bucket: int  # steps per column
    first_step: int
    last_step: int
    steps: int  # distinct steps recorded by the lowest rank
    ranks: list[int]
    start_time: float | None
    end_time: float | None
    series: dict[str, Series] = field(default_factory=dict)
    layers: dict[str, Cells] = field(default_factory=dict)
    subs: dict[str, Cells] = field(default_factory=dict)
    rank_means: dict[str, dict[int, float]] = field(default_factory=dict)  # profile/*
    captures: list[tuple[str, int, int]] = field(default_factory=list)  # tag, count, bytes
    unreadable: list[str] = field(default_factory=list)  # shard path: why
    nonfinite: FirstNonfinite | None = None  # None: the run recorded no NaN/Inf

    def has(self, name: str) -> bool:
        return name in self.series

    def matching(self, pattern: str) -> dict[str, re.Match]:
        """Series names fully matching ``pattern``, with their match, sorted by name."""
        found = ((n, re.fullmatch(pattern, n)) for n in sorted(self.series))
        return {n: m for n, m in found if m}


def load(store: RunStore) -> RunData:
    """Read what the report needs from an open run (every shard it could read)."""
    extent = store.extent()  # from the shards' names and footers: no data read
    first, last, t0, t1 = extent.first_step, extent.last_step, extent.first_time, extent.last_time
    if first is None or t0 is None:  # a footer without statistics: scan for them
        first, last, t0, t1 = store.sql(
            "SELECT min(step), max(step), min(time), max(time) FROM metrics"
        ).fetchall()[0]
    first, last = int(first or 0), int(last or 0)
    steps = 0
    if extent.ranks:  # the lowest rank's distinct steps: a scan of 1/ranks of the run
        (steps,) = store.sql(
            f"SELECT count(DISTINCT step) FROM metrics WHERE rank = {extent.ranks[0]}"
        ).fetchall()[0]
    grid = Grid.spanning(first, last)
    data = RunData(
        info=store.info,
        bucket=grid.size,
        first_step=first,
        last_step=last,
        steps=int(steps or 0),
        ranks=extent.ranks,
        start_time=t0,
        end_time=t1,
    )
    if steps:
        _fill(data, store, grid)
    # After every query: a shard found unreadable by any of them is named.
    data.unreadable = [f"{s.path.name}: {s.error}" for s in store.unreadable]
    return data


def _fill(data: RunData, store: RunStore, grid: Grid) -> None:
    """The curves, heatmaps, profile means, first NaN/Inf and captures of a run."""
    data.nonfinite = first_nonfinite(store)
    every = {name: series for (_, name), series in read_series(store, grid).items()}
    data.series = {n: s for n, s in every.items() if not n.startswith("monitors/layer_")}
    data.layers = layer_cells(every)
    data.subs = _subs(store, every)
    for name, rank, value in store.sql(
        "SELECT name, rank, avg(value) FROM metrics WHERE starts_with(name, 'profile/') "
        "GROUP BY ALL ORDER BY ALL"
    ).fetchall():
        data.rank_means.setdefault(name, {})[int(rank)] = float(value)
    if "captures" in store.tables:
        rows = store.sql(
            "SELECT tag, count(*), sum(nbytes) FROM captures GROUP BY tag ORDER BY tag"
        ).fetchall()
        data.captures = [(str(t), int(n), int(b or 0)) for t, n, b in rows]


def layer_cells(
    series: dict[str, Series], metrics: tuple[str, ...] = LAYER_METRICS
) -> dict[str, Cells]:
    """The per-layer metrics among ``series`` (``monitors/layer_NN/<metric>``, one of
    ``metrics``) as layer x bucket grids, a column per bucket with a record."""
    by_metric: dict[str, dict[int, Series]] = {}
    for name, s in series.items():
        m = LAYER_NAME.fullmatch(name)
        if m and m.group(2) in metrics:
            by_metric.setdefault(m.group(2), {})[int(m.group(1))] = s
    out: dict[str, Cells] = {}
    for metric, layers in sorted(by_metric.items()):
        rows = np.array(sorted(layers))
        used = np.unique(np.concatenate([s.steps for s in layers.values()]))
        low = np.full((len(rows), len(used)), np.nan)
        high = low.copy()
        for r, layer in enumerate(rows.tolist()):
            s = layers[layer]
            c = np.searchsorted(used, s.steps)
            low[r, c], high[r, c] = s.low, s.high
        out[metric] = Cells(rows, used, low, high)
    return out


def _subs(store: RunStore, every: dict[str, Series]) -> dict[str, Cells]:
    """Head x layer and expert x layer at each metric's latest step (worst over ranks).

    Only the records from the earliest last bucket of any such metric on are read: the
    shards' step statistics skip the rest of a long run.
    """
    lasts = [int(s.steps[-1]) for n, s in every.items() if re.match(_SUB_NAME, n)]
    if not lasts:
        return {}
    rows = store.sql(
        f"WITH sub AS ("
        f"  SELECT regexp_extract(name, '{_SUB_NAME}', 2) AS metric,"
        f"  CAST(regexp_extract(name, '{_SUB_NAME}', 1) AS INTEGER) AS layer,"
        f"  CAST(regexp_extract(name, '{_SUB_NAME}', 3) AS INTEGER) AS idx, step, value"
        f"  FROM metrics WHERE step >= {min(lasts)} AND regexp_matches(name, '{_SUB_NAME}')),"
        f" last AS (SELECT metric, max(step) AS step FROM sub GROUP BY metric)"
        f" SELECT metric, idx, layer, min(value), max(value), any_value(step)"
        f" FROM sub JOIN last USING (metric, step) GROUP BY metric, idx, layer"
    ).fetchall()
    grids = _grids([r[:5] for r in rows])
    latest = {r[0]: int(r[5]) for r in rows}
    for metric, cells in grids.items():
        cells.step = latest[metric]
    return grids


def _grids(rows: list[tuple]) -> dict[str, Cells]:
    """``(metric, row, column, low, high)`` rows -> a dense grid per metric."""
    by_metric: dict[str, list[tuple]] = {}
    for row in rows:
        by_metric.setdefault(row[0], []).append(row[1:])
    out: dict[str, Cells] = {}
    for metric, cells in sorted(by_metric.items()):
        array = np.array(cells, dtype=float)
        row_ids, r = np.unique(array[:, 0].astype(int), return_inverse=True)
        col_ids, c = np.unique(array[:, 1].astype(int), return_inverse=True)
        low = np.full((len(row_ids), len(col_ids)), np.nan)
        high = low.copy()
        low[r, c], high[r, c] = array[:, 2], array[:, 3]
        out[metric] = Cells(row_ids, col_ids, low, high)
    return out
