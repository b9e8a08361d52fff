"""A run directory loaded for the HTML report: six DuckDB queries, then numpy.

Every table is aggregated in SQL, by metric and step bucket, so a run of a million
records loads as a few thousand rows. Start at :func:`load`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from syncless.report.nonfinite import FirstNonfinite, first_nonfinite
from syncless.run.store import RunStore

__all__ = ["Cells", "RunData", "Series", "load"]

#: Most columns a heatmap or curve gets. Past it, steps are bucketed (the worst value
#: of a bucket is kept), so a 100k-step run stays a few MB of HTML.
MAX_COLUMNS = 400

# Per-layer metrics read into layer x step matrices: the heatmaps of sections_layers.
LAYER_METRICS = (
    "attn_qk_logit_max",
    "attn_entropy_nats",
    "act_absmax",
    "nonfinite_count",
    "grad_norm",
    "update_ratio",
    "moe_imbalance",
    "moe_tokens_count",
)
_LAYER_NAME = r"^monitors/layer_(\d+)/([^/]+)$"
_SUB_NAME = r"^monitors/layer_(\d+)/([^/]+)/(?:head|expert)_(\d+)$"


@dataclass
class Series:
    """One metric over step buckets; every array is aligned with ``steps``."""

    steps: np.ndarray  # first step of each bucket
    mean: np.ndarray  # over ranks and the steps of a bucket
    low: np.ndarray  # min over ranks and steps
    high: np.ndarray  # max over ranks and steps
    total: float  # sum of every record (counts and bytes add up)
    records: int


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
    steps: int  # distinct steps recorded
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
    first, last, steps, ranks, t0, t1 = store.sql(
        "SELECT min(step), max(step), count(DISTINCT step), "
        "list(DISTINCT rank ORDER BY rank), min(time), max(time) FROM metrics"
    ).fetchall()[0]
    first, last = int(first or 0), int(last or 0)
    bucket = max(1, math.ceil((last - first + 1) / MAX_COLUMNS))
    data = RunData(
        info=store.info,
        bucket=bucket,
        first_step=first,
        last_step=last,
        steps=int(steps or 0),
        ranks=list(ranks or []),
        start_time=t0,
        end_time=t1,
        unreadable=[f"{s.path.name}: {s.error}" for s in store.unreadable],
    )
    if not steps:
        return data
    data.nonfinite = first_nonfinite(store)
    column = f"{first} + (step - {first}) // {bucket} * {bucket}"
    data.series = _series(store, column)
    data.layers = _layers(store, column)
    data.subs = _subs(store)
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
    return data


def _series(store: RunStore, column: str) -> dict[str, Series]:
    rows = store.sql(
        f"SELECT name, {column} AS s, avg(value), min(value), max(value), sum(value), "
        "count(*) FROM metrics WHERE NOT regexp_matches(name, '^monitors/layer_\\d+/') "
        "GROUP BY ALL ORDER BY name, s"
    ).fetchall()
    out: dict[str, Series] = {}
    start = 0
    for end in range(1, len(rows) + 1):  # rows arrive grouped by name
        if end < len(rows) and rows[end][0] == rows[start][0]:
            continue
        cols = np.array([r[1:] for r in rows[start:end]], dtype=float)
        out[rows[start][0]] = Series(
            steps=cols[:, 0].astype(int),
            mean=cols[:, 1],
            low=cols[:, 2],
            high=cols[:, 3],
            total=float(np.nansum(cols[:, 4])),
            records=int(cols[:, 5].sum()),
        )
        start = end
    return out


def _layers(store: RunStore, column: str) -> dict[str, Cells]:
    wanted = ", ".join(f"'{m}'" for m in LAYER_METRICS)
    rows = store.sql(
        f"SELECT metric, layer, s, min(value), max(value) FROM ("
        f"  SELECT regexp_extract(name, '{_LAYER_NAME}', 2) AS metric,"
        f"  CAST(regexp_extract(name, '{_LAYER_NAME}', 1) AS INTEGER) AS layer,"
        f"  {column} AS s, value FROM metrics"
        f"  WHERE regexp_matches(name, '{_LAYER_NAME}')"
        f") WHERE metric IN ({wanted}) GROUP BY ALL"
    ).fetchall()
    return _grids(rows)


def _subs(store: RunStore) -> dict[str, Cells]:
    """Head x layer and expert x layer at each metric's latest step (worst over ranks)."""
    rows = store.sql(
        f"WITH sub AS ("
        f"  SELECT regexp_extract(name, '{_SUB_NAME}', 2) AS metric,"
        f"  CAST(regexp_extract(name, '{_SUB_NAME}', 1) AS INTEGER) AS layer,"
        f"  CAST(regexp_extract(name, '{_SUB_NAME}', 3) AS INTEGER) AS idx, step, value"
        f"  FROM metrics WHERE regexp_matches(name, '{_SUB_NAME}')),"
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
