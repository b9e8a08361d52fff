"""Bands read through rollups (issue #48): compaction sums each shard up per step bucket,
and a chart whose buckets are a multiple of a rollup width reads those sums instead of
every record. Ground truth is numpy over the values the test wrote, never the store's
answer: low and high equal exactly (a one-step spike on one rank included), the mean to
rounding, the record counts exactly, whatever mix of rollups, shards without one, stray
rollups and unreadable ones the run holds."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from syncless.cli import main
from syncless.report.bands import Grid, read_series, read_spans
from syncless.run import ParquetSink, RunStore, StepRecords
from syncless.run.compact import compact_rank, compact_run
from syncless.run.rollups import write_rollup
from syncless.run.rundir import METRICS_DIR, write_run_json
from syncless.run.shards import list_folder, rollup_name

STEPS, RANKS = 30_000, 3
NAMES = ("demo/step/loss", "demo/step/lr")
SPIKE = (1, 12_345, 1e3)  # rank, step, loss: one record, far above every other
CHUNKS = 6  # shards a rank writes, each 5,000 steps: not a multiple of 64
# Grids whose buckets are multiples of rollup widths (64, 64, 256, 1,024) and one that is not.
ALIGNED = (Grid.spanning(0, STEPS - 1), Grid(0, STEPS - 1, 192), Grid(0, STEPS - 1, 512),
           Grid(-1_024, STEPS - 1, 2_048))  # fmt: skip


def values(seed: int) -> np.ndarray:
    """(rank, name, step) -> the value the run records: random walks, and the spike."""
    rng = np.random.default_rng(seed)
    out = np.cumsum(rng.normal(0, 0.01, (RANKS, len(NAMES), STEPS)), axis=2) + 5.0
    if seed == 0:
        out[SPIKE[0], 0, SPIKE[1]] = SPIKE[2]
    return out


def write(run_dir: Path, table: np.ndarray, ranks: range = range(RANKS)) -> Path:
    """Every step of ``ranks``, one shard per CHUNKS-th of the steps, by the run's own
    writer (no compaction of its own)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_json(run_dir, {"name": run_dir.name, "world_size": RANKS})
    for rank in ranks:
        sink = ParquetSink(run_dir / METRICS_DIR, rank, flush_interval_s=3600, compact_every=0)
        for chunk in np.array_split(np.arange(STEPS), CHUNKS):
            records = StepRecords()
            for step in chunk.tolist():
                records.add("t", step, rank, NAMES, table[rank, :, step].tolist(), 1e9 + step)
            sink.write(records)
            sink.flush()
        sink.close()
    return run_dir


def truth(table: np.ndarray, grid: Grid) -> dict[str, np.ndarray]:
    """Per name, per bucket with records: first step, mean, low, high, records, by numpy
    over every rank (DuckDB's NaN order: a NaN is the highest value)."""
    out = {}
    column = (np.arange(STEPS) - grid.first) // grid.size
    for i, name in enumerate(NAMES):
        rows = []
        for b in np.unique(column):
            points = table[:, i, column == b]
            rows.append((grid.first + b * grid.size, points.mean(), np.fmin.reduce(points, None),
                         np.max(points), points.size))  # fmt: skip
        out[name] = np.array(rows)
    return out


def assert_bands(
    series: dict, table: np.ndarray, grid: Grid, run: str = "", names: tuple = NAMES
) -> None:
    for name, want in truth(table, grid).items():
        if name not in names:
            assert (run, name) not in series
            continue
        got = series[run, name]
        assert got.steps.tolist() == want[:, 0].astype(int).tolist()
        np.testing.assert_array_equal(got.low, want[:, 2])  # exactly: min of mins
        np.testing.assert_array_equal(got.high, want[:, 3])
        np.testing.assert_allclose(got.mean, want[:, 1], rtol=1e-12)
        assert got.records == want[:, 4].sum() == RANKS * STEPS


def spied(store: RunStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The queries ``store`` runs from now on."""
    seen: list[str] = []
    real = store.sql

    def sql(query: str):
        seen.append(query)
        return real(query)

    monkeypatch.setattr(store, "sql", sql)
    return seen


def read(run: Path | list[Path], grid: Grid, monkeypatch, **options) -> tuple[dict, bool]:
    """read_series, and whether it read rollups."""
    with RunStore(run) as store:
        queries = spied(store, monkeypatch)
        series = read_series(store, grid, **options)
    return series, any("metrics_rollups" in q for q in queries)


@pytest.fixture(scope="module")
def compacted(tmp_path_factory) -> Path:
    """The run compacted into 3 shards a rank (2 inputs each), each with its rollup."""
    run = write(tmp_path_factory.mktemp("rollups") / "run", values(0))
    stats = compact_run(run, target_rows=20_000)
    assert (stats.shards_after, stats.rollups) == (RANKS * 3, RANKS * 3)
    return run


def copy(run: Path, to: Path) -> Path:
    return shutil.copytree(run, to)


@pytest.mark.parametrize("grid", ALIGNED, ids=lambda g: f"{g.first}+{g.size}")
def test_bands_from_rollups_equal_numpy_over_every_record(compacted, grid, monkeypatch):
    assert grid.rollup_width is not None
    series, rolled = read(compacted, grid, monkeypatch)
    assert rolled
    assert_bands(series, values(0), grid)
    loss = series["", "demo/step/loss"]  # the spike, one record on one rank, is the high
    spiked = grid.first + (SPIKE[1] - grid.first) // grid.size * grid.size
    assert loss.high.max() == SPIKE[2] and loss.steps[np.argmax(loss.high)] == spiked


def test_a_grid_not_aligned_to_a_rollup_width_reads_the_records(compacted, monkeypatch):
    grid = Grid(0, STEPS - 1, 100)
    assert grid.rollup_width is None
    series, rolled = read(compacted, grid, monkeypatch)
    assert not rolled
    assert_bands(series, values(0), grid)


def test_a_half_compacted_run_reads_rollups_and_the_rest_record_by_record(tmp_path, monkeypatch):
    table = values(0)
    run = write(tmp_path / "run", table, ranks=range(2))
    for rank in range(2):  # the first 4 shards of ranks 0 and 1 merged, the last 2 not
        compact_rank(run / METRICS_DIR, rank, target_rows=40_000, min_inputs=4)
    write(run, table, ranks=range(2, 3))  # rank 2: never compacted
    listing = list_folder(run / METRICS_DIR)
    assert len(listing.rollups) == 2 and len(listing.visible) == 2 + 2 * 2 + CHUNKS
    grid = ALIGNED[0]
    with RunStore(run) as store:
        rolled, raw = (store.query(f"SELECT count(*) FROM {v}")[1][0][0]
                       for v in ("metrics_rollups", "metrics_unrolled"))  # fmt: skip
        assert rolled > 0 and raw == (RANKS * CHUNKS - 2 * 4) * len(NAMES) * STEPS // CHUNKS
    series, used = read(run, grid, monkeypatch)
    assert used
    assert_bands(series, table, grid)


def test_stray_rollups_of_covered_or_missing_shards_are_ignored_then_deleted(tmp_path, monkeypatch):
    table = values(0)
    run = write(tmp_path / "run", table)
    metrics = run / METRICS_DIR
    compact_run(run, target_rows=20_000)  # shards of 2 inputs, with rollups
    early = {p.name: p.read_bytes() for p in metrics.iterdir() if p.name.startswith("rank00000-")}
    compact_run(run, target_rows=1_000_000)  # one shard a rank: the first ones covered
    # A compactor killed after its merged shard appeared, before deleting an input and
    # its rollup: both back, covered. And a rollup whose shard is gone altogether.
    for name, data in early.items():
        (metrics / name).write_bytes(data)
    kept = list_folder(metrics).visible[1][0]  # rank 1's shard: a rollup for a shard never there
    shutil.copy(metrics / rollup_name(kept), metrics / rollup_name(kept.replace(".n", ".n9")))
    listing = list_folder(metrics)
    assert len(listing.covered) == 3 and len(listing.stray_rollups) == 3 + 1
    for grid in ALIGNED:
        series, rolled = read(run, grid, monkeypatch)
        assert rolled
        assert_bands(series, table, grid)
    assert main(["check", str(run)]) == 0  # a note, not a problem
    stats = compact_run(run)
    assert stats.removed == 3 + 3 + 1
    listing = list_folder(metrics)
    assert not listing.covered and not listing.stray_rollups and len(listing.rollups) == RANKS


def test_an_old_run_without_rollups_reads_its_records_and_compact_adds_them(
    compacted, tmp_path, monkeypatch
):
    run = copy(compacted, tmp_path / "old")
    for rollup in (run / METRICS_DIR).glob("*.rollup"):
        rollup.unlink()  # compacted before rollups existed
    grid = ALIGNED[0]
    series, rolled = read(run, grid, monkeypatch)
    assert not rolled
    assert_bands(series, values(0), grid)
    stats = compact_run(run, target_rows=20_000)  # nothing to merge: rollups are written
    assert (stats.shards_before, stats.shards_after, stats.rows, stats.rollups) == (9, 9, 0, 9)
    listing = list_folder(run / METRICS_DIR)
    assert len(listing.rollups) == len(listing.visible) == 9
    series, rolled = read(run, grid, monkeypatch)
    assert rolled
    assert_bands(series, values(0), grid)


@pytest.mark.parametrize(
    ("where", "rolls"),
    [
        ("name = 'demo/step/loss'", True),
        ("rank IN (0, 1, 2) AND starts_with(name, 'demo/')", True),
        ("step >= 0", False),  # a rollup row's step is its bucket's: the records decide
        ("value > -1e300", False),
        ("time > 0", False),
    ],
)
def test_a_where_on_more_than_run_name_and_rank_reads_the_records(
    compacted, where, rolls, monkeypatch
):
    grid = ALIGNED[0]
    series, rolled = read(compacted, grid, monkeypatch, where=where)
    assert rolled == rolls
    names = ("demo/step/loss",) if "loss" in where else NAMES
    assert_bands(series, values(0), grid, names=names)


def test_a_where_on_the_rank_takes_only_that_ranks_rollups(compacted, monkeypatch):
    grid = ALIGNED[2]
    series, rolled = read(compacted, grid, monkeypatch, where="rank = 1")
    assert rolled
    table = values(0)[1:2]
    want = truth(table, grid)["demo/step/loss"]
    got = series["", "demo/step/loss"]
    np.testing.assert_array_equal(got.high, want[:, 3])
    np.testing.assert_array_equal(got.low, want[:, 2])
    assert got.records == STEPS and got.high.max() == SPIKE[2]


def test_bands_by_run_over_several_compacted_runs(compacted, tmp_path, monkeypatch):
    other = write(tmp_path / "other", values(2))
    compact_run(other, target_rows=25_000)
    grid = ALIGNED[1]
    where = "name IN ('demo/step/loss', 'demo/step/lr')"
    series, rolled = read([compacted, other], grid, monkeypatch, where=where, by_run=True)
    assert rolled
    assert_bands(series, values(0), grid, run="run")
    assert_bands(series, values(2), grid, run="other")
    with RunStore([compacted, other]) as store:
        spans = sorted(read_spans(store))
    assert spans == [(run, name, 0, STEPS - 1, RANKS * STEPS)
                     for run in ("other", "run") for name in NAMES]  # fmt: skip


def test_nan_inf_and_null_values_give_the_bands_of_the_records(tmp_path, monkeypatch):
    table = values(3)
    table[0, 0, 100] = np.nan  # a NaN among numbers: the bucket's high is NaN
    table[:, 1, 6_400:6_464] = np.nan  # a bucket of NaN alone: low and high NaN
    table[2, 0, 20_000] = -np.inf
    table[1, 1, 7_000] = np.inf
    run = write(tmp_path / "run", table)
    compact_run(run, target_rows=20_000)
    for grid in ALIGNED[:3]:
        series, rolled = read(run, grid, monkeypatch)
        raw, records = read(run, grid, monkeypatch, where="time > 0")
        assert rolled and not records
        for name, want in truth(table, grid).items():
            got = series["", name]
            np.testing.assert_array_equal(got.low, want[:, 2])
            np.testing.assert_array_equal(got.high, want[:, 3])
            np.testing.assert_allclose(got.mean, want[:, 1], rtol=1e-12)
            np.testing.assert_array_equal(got.high, raw["", name].high)


def test_an_unreadable_rollup_is_skipped_and_its_shard_read(compacted, tmp_path, monkeypatch,
                                                            caplog, capsys):  # fmt: skip
    run = copy(compacted, tmp_path / "torn")
    rollup = sorted((run / METRICS_DIR).glob("*.rollup"))[4]
    rollup.write_bytes(rollup.read_bytes()[:100])  # cut short
    grid = ALIGNED[0]
    with caplog.at_level(logging.WARNING, "syncless.run.store"):
        series, rolled = read(run, grid, monkeypatch)
    assert rolled and f"unreadable rollup {rollup}" in caplog.text
    assert_bands(series, values(0), grid)
    assert main(["check", str(run)]) == 1
    assert f"unreadable rollup {rollup}" in capsys.readouterr().out.replace("\n", "")


def test_check_finds_a_rollup_that_miscounts_its_shard(compacted, tmp_path, capsys):
    run = copy(compacted, tmp_path / "short")
    metrics = run / METRICS_DIR
    shard = sorted(metrics.glob("rank00002-*.parquet"))[1]
    write_rollup(metrics, shard.name, pq.read_table(shard).slice(0, 100))  # 100 of 20,000
    assert main(["check", str(run)]) == 1
    out = capsys.readouterr().out.replace("\n", "")
    assert f"rollup {metrics / rollup_name(shard.name)} sums up 100 records at width 64, its " \
           "shard holds 20000" in out  # fmt: skip
