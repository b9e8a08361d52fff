"""How a chart shows a long run: min/max bands per step bucket, computed in DuckDB.

A run of a million steps cannot be drawn point by point: the page would weigh
hundreds of MB and the browser would stall. As wandb does, steps are cut into at most
:data:`MAX_COLUMNS` buckets of equal width (a :class:`Grid`), and each bucket keeps
the lowest and highest value in it, every rank included, and their mean. The band
between low and high holds every recorded point, so a spike survives downsampling;
the mean is the line. One DuckDB ``GROUP BY`` does the work over the whole run;
Python only splits its few thousand rows by metric.

A long run is read through its rollups (syncless.run.rollups): compaction sums each
shard's records per bucket of 64, 256, ... steps, and a chart whose buckets are a
multiple of such a width, aligned to it, adds whole rollup buckets up, exactly, and
reads the shards without a rollup record by record, in the same ``GROUP BY``. On 64
ranks x 1,000,000 steps (257.6M records, 2-core CPU) that is 1.6M rollup rows in
0.13-0.30 s, where the scan of every record took 5-7 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from syncless.errors import UsageError
from syncless.run.shards import ROLLUP_WIDTHS
from syncless.run.store import RunStore

__all__ = ["MAX_COLUMNS", "Grid", "Series", "floats", "read_series", "read_spans", "split_rows"]

#: Most buckets a chart or heatmap gets. 400 columns keep a chart readable on a wide
#: screen, and a page of a few hundred charts within a few MB.
MAX_COLUMNS = 400
#: A grid of buckets of at least 64 steps is aligned to the widest rollup width at most
#: an eighth of its bucket: the bucket grows by less than an eighth (never below 356 of
#: 400 columns), and a bucket sums up at most 32 rollup rows a series (10 of 256 steps for
#: the 2,560 of a 1,000,000-step run). Below 512 steps a bucket is aligned to 64, and
#: keeps at least half its columns.
ALIGN_SHARE = 8


@dataclass(frozen=True)
class Grid:
    """Step buckets every chart of a page shares: bucket ``b`` holds the steps
    ``first + b * size`` to ``first + (b + 1) * size - 1``, and is named by its first."""

    first: int
    last: int
    size: int  # steps per bucket

    @classmethod
    def spanning(cls, first: int, last: int, columns: int = MAX_COLUMNS) -> Grid:
        """The narrowest buckets that fit ``first..last`` in ``columns`` columns; from 64
        steps a bucket on, a multiple of a rollup width, starting at a multiple of it
        (:data:`ALIGN_SHARE`), so that rollups can be read for it."""
        size = max(1, math.ceil((last - first + 1) / columns))
        if size < ROLLUP_WIDTHS[0]:
            return cls(first, last, size)
        width = max((w for w in ROLLUP_WIDTHS if w * ALIGN_SHARE <= size), default=ROLLUP_WIDTHS[0])
        first -= first % width  # down to a multiple (Python's % floors)
        size = -(-(last - first + 1) // (columns * width)) * width
        return cls(first, last, size)

    @property
    def rollup_width(self) -> int | None:
        """The widest rollup width whose buckets fall whole into this grid's: the grid's
        bucket and first step are multiples of it. None when there is none."""
        fits = [w for w in ROLLUP_WIDTHS if self.size % w == 0 and self.first % w == 0]
        return max(fits, default=None)

    def bucket(self, step: str = "step") -> str:
        """SQL for the first step of the bucket ``step`` falls in."""
        return f"({self.first} + ({step} - {self.first}) // {self.size} * {self.size})"

    @property
    def columns(self) -> int:
        return (self.last - self.first) // self.size + 1


@dataclass
class Series:
    """One metric over step buckets; every array is aligned with ``steps``."""

    steps: np.ndarray  # first step of each bucket
    mean: np.ndarray  # over ranks and the steps of a bucket
    low: np.ndarray  # min over ranks and steps
    high: np.ndarray  # max over ranks and steps
    total: float  # sum of every record (counts and bytes add up)
    records: int


def read_series(
    store: RunStore, grid: Grid, where: str = "", by_run: bool = False
) -> dict[tuple[str, str], Series]:
    """Every metric's bands on ``grid``, by (run, name): one scan of ``metrics``.

    ``where``: an SQL condition on the records (without WHERE); ``by_run``: one series
    per run of a store of several (else the run is ""). A bucket without records has
    no entry, so gaps stay gaps.
    """
    run = "run" if by_run else "''"
    condition = f"WHERE {where}" if where else ""
    width = grid.rollup_width
    if width is None or not store.rollups or not _on_keys(store, where):
        # The mean is total / records, not a fifth aggregate: a hash aggregate over every
        # record is the whole cost here (2.7 s, against 4.1 s with avg(), on 65.6M records).
        source = f"metrics {condition}"
        sums = "min(value) AS low, max(value) AS high, sum(value) AS total, count(*) AS records"
    else:  # whole rollup buckets, and the records of the shards without a rollup
        also = f"AND ({where})" if where else ""
        source = (
            f"(SELECT run, name, step, low, high, total, records FROM metrics_rollups "
            f"WHERE width = {width} {also} UNION ALL SELECT run, name, step, value, value, "
            f"value, 1 FROM metrics_unrolled {condition})"
        )
        sums = (
            "min(low) AS low, max(high) AS high, sum(total) AS total, "
            "sum(records)::BIGINT AS records"
        )
    relation = store.sql(
        f"SELECT {run} AS run, name, {grid.bucket()} AS s, {sums} "
        f"FROM {source} GROUP BY ALL ORDER BY run, name, s"
    )
    return split_rows(relation.fetchnumpy(), ("run", "name"))


def read_spans(store: RunStore) -> list[tuple[str, str, int, int, int]]:
    """(run, name, first step, last step, records) of every metric of every run, from
    the widest rollups where the shards have them."""
    if not store.rollups:
        query = "SELECT run, name, min(step), max(step), count(*) FROM metrics GROUP BY ALL"
    else:
        query = (
            "SELECT run, name, min(first_step), max(last_step), sum(records)::BIGINT FROM ("
            "SELECT run, name, first_step, last_step, records FROM metrics_rollups "
            f"WHERE width = {ROLLUP_WIDTHS[-1]} UNION ALL "
            "SELECT run, name, step, step, 1 FROM metrics_unrolled) GROUP BY ALL"
        )
    return store.sql(query).fetchall()


# The columns a rollup keeps of a record besides its step: a condition on these alone
# means the same on a rollup row as on the records it sums up.
_KEYS = "SELECT NULL::VARCHAR AS run, NULL::VARCHAR AS name, NULL::INTEGER AS rank"


def _on_keys(store: RunStore, where: str) -> bool:
    """Whether ``where`` reads only the run, name and rank of a record (it binds over
    them alone), so that rollups can answer it."""
    if not where:
        return True
    try:
        store.sql(f"SELECT 1 FROM ({_KEYS}) WHERE {where}")
    except UsageError:
        return False
    return True


def split_rows(columns: dict[str, np.ndarray], keys: tuple[str, ...]) -> dict[tuple, Series]:
    """Rows sorted by ``keys`` then bucket ``s`` -> one Series per key."""
    n = len(columns["s"])
    if n == 0:
        return {}
    values = {k: floats(columns[k]) for k in ("low", "high", "total")}
    records = np.asarray(columns["records"], dtype=np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        values["mean"] = values["total"] / records  # NaN where every value was NULL
    steps = np.asarray(columns["s"], dtype=np.int64)
    change = np.zeros(n, dtype=bool)
    for key in keys:
        column = columns[key]
        change[1:] |= column[1:] != column[:-1]
    starts = np.flatnonzero(change | (np.arange(n) == 0))
    ends = np.append(starts[1:], n)
    out: dict[tuple, Series] = {}
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        out[tuple(str(columns[k][start]) for k in keys)] = Series(
            steps=steps[start:end],
            mean=values["mean"][start:end],
            low=values["low"][start:end],
            high=values["high"][start:end],
            total=float(np.nansum(values["total"][start:end])),
            records=int(records[start:end].sum()),
        )
    return out


def floats(column: np.ndarray) -> np.ndarray:
    """A column of ``fetchnumpy()`` as float64, NULL (a masked entry) as NaN."""
    if isinstance(column, np.ma.MaskedArray):
        return column.astype(np.float64).filled(np.nan)
    return np.asarray(column, dtype=np.float64)
