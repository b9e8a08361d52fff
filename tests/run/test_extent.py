"""``RunStore.extent``: the steps, ranks and times a run spans, from shard names and
footers, equal to what DuckDB finds scanning the files."""

from __future__ import annotations

import duckdb
from run_store_helpers import make_run, truncate, write_shards

from syncless.run import RunStore
from syncless.run.rundir import METRICS_DIR


def test_the_extent_is_what_a_scan_of_the_files_finds(tmp_path):
    run = make_run(tmp_path / "run", world_size=3)
    write_shards(run, 0, [[0, 1, 2], [3, 4]])
    write_shards(run, 2, [[7, 9]])
    scan = duckdb.sql(
        f"SELECT min(step), max(step), list(DISTINCT rank ORDER BY rank), min(time), max(time) "
        f"FROM read_parquet('{run / METRICS_DIR}/*.parquet')"
    ).fetchall()[0]
    with RunStore(run) as store:
        assert tuple(store.extent()) == scan == (0, 9, [0, 2], 1000.0, 1009.0)


def test_an_unreadable_shard_is_left_out_as_a_query_leaves_it_out(tmp_path, caplog):
    run = make_run(tmp_path / "run", world_size=2)
    write_shards(run, 0, [[0, 1]])
    (bad,) = write_shards(run, 1, [[5, 6]])
    truncate(bad)
    with RunStore(run) as store:
        assert tuple(store.extent()) == (0, 1, [0], 1000.0, 1001.0)
    assert bad.name in caplog.text


def test_a_run_without_records_spans_nothing(tmp_path):
    with RunStore(make_run(tmp_path / "run")) as store:
        assert tuple(store.extent()) == (None, None, [], None, None)
