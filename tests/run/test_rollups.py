"""Rollups (syncless.run.rollups): a shard's records summed up per step bucket, written
by compaction beside the shard. Ground truth is numpy over the records the test made,
with DuckDB's rules for NULL and NaN spelled out here (NULL skipped but counted, NaN
above every number)."""

from __future__ import annotations

import collections

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from run_store_helpers import make_run, write_shards

from syncless.run import ParquetSink, StepRecord
from syncless.run import open as open_run
from syncless.run.parquet import SCHEMA as RECORDS
from syncless.run.rollups import SCHEMA, WIDTHS, rollup
from syncless.run.shards import catalogue, list_folder, rollup_name, rollup_shard

SHARD = "rank00003-000001-000040.s0_4999.n2560000.parquet"


def test_the_query_path_spells_the_rollup_schema_as_the_writer_does():
    from syncless.run.store import ROLLUP_COLUMNS

    duckdb_type = {"string": "VARCHAR", "int64": "BIGINT", "int32": "INTEGER", "double": "DOUBLE"}
    assert tuple((f.name, duckdb_type[str(f.type)]) for f in SCHEMA) == ROLLUP_COLUMNS


def test_a_rollup_is_named_by_its_shard_and_a_listing_sorts_them():
    assert rollup_name(SHARD) == "rank00003-000001-000040.s0_4999.n2560000.rollup"
    assert rollup_shard(rollup_name(SHARD)) == SHARD
    assert rollup_shard("rank00003-000007.rollup") == "rank00003-000007.parquet"  # old names
    assert rollup_shard(".rank00003-000001-000040.s0_4999.n2560000.rollup.1.tmp") is None
    assert rollup_shard("notes.rollup") is None
    covered = "rank00003-000001-000020.s0_2499.n1280000.parquet"
    listing = catalogue([SHARD, rollup_name(SHARD), covered, rollup_name(covered),
                         rollup_name(SHARD.replace("-000001-", "-000041-")), "x.json"])  # fmt: skip
    assert [name for name, _ in listing.visible] == [SHARD]
    assert listing.rollups == {SHARD: rollup_name(SHARD)}
    assert listing.stray_rollups == sorted(
        [rollup_name(covered), rollup_name(SHARD.replace("-000001-", "-000041-"))]
    )
    assert listing.other == ["x.json"]


def records(n: int, seed: int) -> tuple[pa.Table, dict]:
    """``n`` records of 2 ranks x 3 names over steps -300..99,999 in no order, with NaN,
    +-inf and NULL values; and their truth: width -> (run, name, rank, bucket) ->
    (first step, last step, low, high, total, records), by numpy."""
    rng = np.random.default_rng(seed)
    step = rng.integers(-300, 100_000, n)
    value = rng.normal(size=n)
    value[rng.random(n) < 0.01] = np.nan
    value[rng.random(n) < 0.002] = np.inf
    value[rng.random(n) < 0.002] = -np.inf
    null = rng.random(n) < 0.02
    null[(step >= 64_000) & (step < 64_064)] = True  # a bucket of NULLs alone, at width 64
    name = np.array(["a", "b", "c"])[rng.integers(0, 3, n)]
    rank = rng.integers(0, 2, n).astype(np.int32)
    table = pa.table({"run": ["r"] * n, "step": step, "rank": rank, "name": name,
                      "value": pa.array(value, mask=null), "time": np.zeros(n)},
                     schema=RECORDS)  # fmt: skip
    truth: dict[int, dict] = {}
    for width in WIDTHS:
        groups = collections.defaultdict(list)
        for i in range(n):
            groups["r", name[i], int(rank[i]), int(step[i] // width * width)].append(i)
        out = truth[width] = {}
        for key, rows in groups.items():
            kept = value[rows][~null[rows]]
            nan = np.isnan(kept)
            if kept.size == 0:
                low = high = total = None
            else:  # DuckDB: NaN is the highest value; min is NaN only when all are
                low = float(kept[~nan].min()) if (~nan).any() else float("nan")
                high = float("nan") if nan.any() else float(kept.max())
                with np.errstate(invalid="ignore"):  # inf + -inf
                    total = float(kept.sum())
            out[key] = (int(step[rows].min()), int(step[rows].max()), low, high, total, len(rows))
    return table, truth


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (np.isnan(a) and np.isnan(b)) or a == b or abs(a - b) <= 1e-9 * abs(b)
    return a == b


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_rollup_holds_each_buckets_min_max_sum_and_count_at_every_width(chunks):
    table, truth = records(20_000, seed=chunks)
    if chunks > 1:  # as a merge concatenates its inputs
        table = pa.concat_tables([table.slice(0, 7_000), table.slice(7_000, 3), table.slice(7_003)])
    got = rollup(table)
    assert got.schema == SCHEMA
    assert sorted(set(got["width"].to_pylist())) == list(WIDTHS)
    for width in WIDTHS:
        rows = got.filter(pa.compute.equal(got["width"], width)).to_pylist()
        found = {(r["run"], r["name"], r["rank"], r["step"]): tuple(list(r.values())[5:])
                 for r in rows}  # fmt: skip
        assert len(found) == len(rows) == len(truth[width])
        for key, want in truth[width].items():
            assert all(same(g, w) for g, w in zip(found[key], want, strict=True)), (width, key)
    assert got.filter(pa.compute.equal(got["width"], 64))["records"].to_numpy().sum() == 20_000


def test_a_rollup_of_nothing_and_of_a_record_without_a_step():
    assert rollup(RECORDS.empty_table()).num_rows == 0
    table = pa.table({"run": ["r"], "step": pa.array([None], pa.int64()), "rank": [0],
                      "name": ["a"], "value": [1.0], "time": [0.0]}, schema=RECORDS)  # fmt: skip
    assert rollup(table) is None  # that shard is read record by record


def test_a_live_writer_writes_the_rollups_of_what_it_merges(tmp_path):
    run = make_run(tmp_path / "run")
    sink = ParquetSink(run / "metrics", 0, flush_interval_s=3600, compact_every=4)
    for step in range(10):
        sink.write([StepRecord("t", step, 0, f"test/step/m{i}", float(i), 0.0) for i in range(3)])
        sink.flush()
    sink.close()
    listing = list_folder(run / "metrics")
    shards = [name for name, _ in listing.visible]
    assert [(s.first_seq, s.last_seq) for _, s in listing.visible] == [(1, 8), (9, 9), (10, 10)]
    # The merge of 1-4 (and its rollup) was merged again into 1-8: no stray left.
    assert listing.rollups == {shards[0]: rollup_name(shards[0])} and not listing.stray_rollups
    summary = pq.read_table(run / "metrics" / rollup_name(shards[0])).to_pylist()
    assert {
        (r["name"], r["records"], r["low"], r["high"]) for r in summary if r["width"] == 64
    } == {(f"test/step/m{i}", 8, float(i), float(i)) for i in range(3)}


def test_a_store_reads_each_record_once_through_metrics_rollups_and_metrics_unrolled(tmp_path):
    run = make_run(tmp_path / "run", world_size=2)
    for rank in range(2):
        write_shards(run, rank, [[s, s + 1] for s in range(0, 40, 2)], names=3)
    from syncless.run.compact import compact_rank

    compact_rank(run / "metrics", 0, target_rows=30)  # rank 0: merged, rank 1: not
    with open_run(run) as store:
        assert len(store.rollups) == len(list_folder(run / "metrics").rollups) > 0
        _, rows = store.query(
            "SELECT rank, sum(n) FROM (SELECT rank, records AS n FROM metrics_rollups WHERE "
            "width = 64 UNION ALL SELECT rank, 1 FROM metrics_unrolled) GROUP BY ALL ORDER BY 1"
        )
        assert rows == [(0, 120), (1, 120)]
        _, files = store.query("SELECT DISTINCT file FROM metrics_rollups")
        assert sorted(f for (f,) in files) == sorted(
            str(p.resolve()) for p in store.rollups.values()
        )
