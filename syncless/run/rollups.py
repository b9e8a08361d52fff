"""Rollups: a shard's records summed up per step bucket, so a report reads megabytes.

A chart of a long run draws min/max bands over a few hundred step buckets
(syncless.report.bands): every record of the run goes through one ``GROUP BY``. On 64
ranks x 1,000,000 steps (257.6M records, bench/store/report_scale.py) that scan was
5-7 s of the report's 8.7 s on a 2-core CPU. So compaction, which holds a merged
shard's records in memory anyway, also writes its rollup: per (run, name, rank) and
step bucket, the lowest and highest value, their sum and the record count (and the
bucket's first and last recorded step). A bucket of width ``W`` holds the steps
``k * W`` to ``(k + 1) * W - 1`` (aligned at step 0, whatever the shard's first step),
so a bucket of a chart whose width is a multiple of ``W`` and whose first step is one
gathers whole rollup buckets: min of mins, max of maxes, sum of sums. The bands are
exact: a one-step spike on one rank is some bucket's max, and the mean is
``sum(total) / sum(records)`` as the raw scan's ``sum(value) / count(*)``.

Widths (:data:`WIDTHS`): 64, 256, ... 65,536 steps, each four times the last, all in
one file (the ``width`` column; rows sorted by width, so a reader's ``width = W``
skips the other levels' row groups). A chart takes the widest level its bucket is a
multiple of, so it reads about ``records / W`` rows with ``W`` at least an eighth of
its bucket (syncless.report.bands.Grid). Measured on bench/store/report_scale.py's run
(64 ranks x 1M steps, 257.6M records; 2-core CPU): one level per file at W = 64 was
5.6M rows, 182 MB, read and grouped in 0.36 s; W = 256 1.6M rows, 51 MB, 0.13 s; W =
1,024 0.4M rows, 13 MB, 0.06 s. 64 is the narrowest: a run of 25,600 steps (400
columns of 64) already gets it, and a narrower level would be larger still (a rollup
row holds three values and a count where a record holds one value, and a metric
recorded every 100 steps is not shrunk by a bucket of 64). Four times per level keeps
a chart's bucket within an eighth of what it would be unaligned. All six levels of
that run, written as below: 180 MB beside its 3.8 GB of shards.

Values follow DuckDB's ``min``/``max``/``sum``/``count(*)`` exactly: NULL values are
skipped but counted as records, NaN is above every number (a bucket with one NaN has a
NaN high, and a NaN low only when all its values are NaN), a bucket of NULLs alone has
NULL low, high and total. Computed with numpy and pyarrow (a sort and ``reduceat``: no
loop per row, no DuckDB in a training process): 0.08-0.13 s for a million records,
about 30 ms computed and written for a live merge's 65,536, 0.9-2.5 s for that run's
largest shard (5.6M records).

The file is the shard's name with ``.rollup`` for ``.parquet`` (syncless.run.shards),
written whole (a rename, or one PUT) before its shard: a reader uses a rollup only
while the shard it names is visible, and reads every other visible shard record by
record, so whatever point a compaction is killed at, each record counts once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from syncless.run.shards import ROLLUP_WIDTHS, rollup_name
from syncless.run.storage import write_parquet

if TYPE_CHECKING:
    from syncless.run.storage import RunPath

__all__ = ["ROW_GROUP_ROWS", "SCHEMA", "WIDTHS", "rollup", "write_rollup"]

#: The bucket widths of a rollup, in steps: 64, 256, 1,024, 4,096, 16,384, 65,536.
WIDTHS = ROLLUP_WIDTHS
#: Rows per row group: a reader that wants one width skips the others' groups.
ROW_GROUP_ROWS = 1 << 16
_STEPS = ("step", "first_step", "last_step")
#: How a rollup is written: the step columns delta-encoded (rows go up by a bucket at a
#: time: a third off the file, 90 -> 61 MB for rank 0 of bench/store/report_scale.py),
#: the keys as dictionaries. low, high and total are most of what is left.
WRITE_OPTIONS = {
    "row_group_size": ROW_GROUP_ROWS,
    "use_dictionary": ["width", "run", "name", "rank", "records"],
    "column_encoding": dict.fromkeys(_STEPS, "DELTA_BINARY_PACKED"),
}

SCHEMA = pa.schema(
    [
        ("width", pa.int32()),  # steps per bucket
        ("run", pa.string()),
        ("name", pa.string()),
        ("rank", pa.int32()),
        ("step", pa.int64()),  # the bucket's first step: a multiple of width
        ("first_step", pa.int64()),  # its first and last recorded step
        ("last_step", pa.int64()),
        ("low", pa.float64()),  # min(value)
        ("high", pa.float64()),  # max(value)
        ("total", pa.float64()),  # sum(value)
        ("records", pa.int64()),  # count(*)
    ]
)


def rollup(table: pa.Table, widths: tuple[int, ...] = WIDTHS) -> pa.Table | None:
    """The rollup of a metrics ``table`` (syncless.run.parquet.SCHEMA) at each of
    ``widths`` (powers of 2, each a multiple of the one before); None when a record has
    no step (its shard is then read record by record)."""
    if table["step"].null_count:
        return None
    if table.num_rows == 0:
        return SCHEMA.empty_table()
    keys = [_encoded(table[c]) for c in ("run", "name", "rank")]
    sizes = [len(k.dictionary) for k in keys]
    series = np.zeros(table.num_rows, dtype=np.int64)  # one number per (run, name, rank)
    for key, size in zip(keys, sizes, strict=True):
        if size > 1:
            series = series * size + key.indices.to_numpy()
    step = table["step"].to_numpy()
    order = _order(series, step, widths[0])
    series, step = series[order], step[order]
    values = table["value"]
    value = values.to_numpy(zero_copy_only=False)[order]
    # One level from the records, each wider one from the level before: rows sorted by
    # (series, bucket) stay sorted by (series, wider bucket). A NULL value stands as NaN
    # in the low (np.fmin skips NaN unless all are), -inf in the high (np.maximum keeps
    # NaN), 0 in the total, and is no value (``values``) though it is a record.
    if values.null_count:
        valid = values.is_valid().to_numpy(zero_copy_only=False)[order]
        low, high = np.where(valid, value, np.nan), np.where(valid, value, -np.inf)
        total, counted = np.where(valid, value, 0.0), valid.astype(np.int64)
    else:
        low = high = total = value
        counted = None  # every record has a value
    level = _Level(series, step, step, step, low, high, total, counted, None)
    tables = []
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN, as in DuckDB
        for width in widths:
            level = level.coarser(width)
            tables.append(level.table(width, keys, sizes))
    return pa.concat_tables(tables)


def write_rollup(folder: RunPath, shard: str, table: pa.Table) -> str | None:
    """Write the rollup of the shard named ``shard`` in ``folder``, whose records are
    ``table``, whole or not at all; its file name, None when it has none."""
    summary = rollup(table)
    if summary is None:
        return None
    name = rollup_name(shard)
    write_parquet(summary, folder / name, **WRITE_OPTIONS)
    return name


def _encoded(column: pa.ChunkedArray) -> pa.DictionaryArray:
    """``column`` as one dictionary array (NULL an entry of its own); a column of one
    value, as a rank's shard has for rank and run, without hashing every row."""
    bounds = pc.min_max(column)
    if column.null_count == 0 and bounds["min"] == bounds["max"]:
        dictionary = pa.array([bounds["min"].as_py()], type=column.type)
        indices = pa.array(np.zeros(len(column), dtype=np.int32))
        return pa.DictionaryArray.from_arrays(indices, dictionary)
    return pc.dictionary_encode(column, null_encoding="encode").combine_chunks()


def _order(series: np.ndarray, step: np.ndarray, width: int) -> np.ndarray:
    """The permutation that sorts the records by (series, step // width)."""
    shift = width.bit_length() - 1  # widths are powers of 2: a shift is a floor division
    bucket = step >> shift
    low = int(bucket.min())
    buckets = int(bucket.max()) - low + 1
    if buckets * (int(series.max()) + 1) < 2**62:  # one int64 key: a single argsort
        return np.argsort(series * buckets + (bucket - low), kind="stable")
    return np.lexsort((bucket, series))  # steps spread too far for one key


class _Level:
    """Rows sorted by (series, bucket) and what they sum up: their first and last step,
    low, high and total (NULLs stood in for, see :func:`rollup`), values and records
    (None: one each; values None: as many as records)."""

    def __init__(
        self, series: np.ndarray, bucket: np.ndarray, first: np.ndarray, last: np.ndarray,
        low: np.ndarray, high: np.ndarray, total: np.ndarray,
        values: np.ndarray | None, records: np.ndarray | None,
    ) -> None:  # fmt: skip
        self.series, self.bucket, self.first, self.last = series, bucket, first, last
        self.low, self.high, self.total = low, high, total
        self.values, self.records = values, records

    def coarser(self, width: int) -> _Level:
        bucket = self.bucket & -width  # a floor to a multiple of width (a power of 2)
        change = np.empty(len(bucket), dtype=bool)
        change[0] = True
        np.not_equal(self.series[1:], self.series[:-1], out=change[1:])
        change[1:] |= bucket[1:] != bucket[:-1]
        starts = np.flatnonzero(change)
        if self.records is None:
            records = np.diff(starts, append=len(bucket))
        else:
            records = np.add.reduceat(self.records, starts)
        values = None if self.values is None else np.add.reduceat(self.values, starts)
        return _Level(
            self.series[starts],
            bucket[starts],
            np.minimum.reduceat(self.first, starts),
            np.maximum.reduceat(self.last, starts),
            np.fmin.reduceat(self.low, starts),
            np.maximum.reduceat(self.high, starts),
            np.add.reduceat(self.total, starts),
            values,
            records,
        )

    def table(self, width: int, keys: list[pa.DictionaryArray], sizes: list[int]) -> pa.Table:
        indices = []
        rest = self.series
        for size in reversed(sizes):
            indices.append(rest % size)
            rest = rest // size
        run, name, rank = (
            key.dictionary.take(pa.array(index))
            for key, index in zip(keys, reversed(indices), strict=True)
        )
        empty = None if self.values is None else self.values == 0  # NULL values alone
        columns = {
            "width": pa.array(np.full(len(self.series), width, dtype=np.int32)),
            "run": run,
            "name": name,
            "rank": rank,
            "step": self.bucket,
            "first_step": self.first,
            "last_step": self.last,
            "low": pa.array(self.low, mask=empty),
            "high": pa.array(self.high, mask=empty),
            "total": pa.array(self.total, mask=empty),
            "records": self.records,
        }
        return pa.table(columns, schema=SCHEMA)
