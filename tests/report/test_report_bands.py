"""Min/max bands per step bucket (issue #48), against numpy over the records the test
wrote: every point inside its bucket's band, a spike kept, the bucket count bounded."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from syncless.report.bands import MAX_COLUMNS, Grid, read_series
from syncless.run import ParquetSink, RunStore, StepRecords
from syncless.run.rundir import METRICS_DIR, write_run_json

STEPS, RANKS = 10_007, 3  # a prime: the last bucket is a partial one
SPIKE = (1, 4_321, 50.0)  # rank, step, value


def values(seed: int) -> np.ndarray:
    """(rank, step) -> the loss the run records: a noisy decay, and one spike."""
    rng = np.random.default_rng(seed)
    out = 5 * np.exp(-np.arange(STEPS) / 3000)[None, :] + rng.normal(0, 0.05, (RANKS, STEPS))
    if seed == 0:
        out[SPIKE[0], SPIKE[1]] = SPIKE[2]
    return out


def write(run_dir: Path, loss: np.ndarray, every: int = 1) -> Path:
    run_dir.mkdir(parents=True)
    write_run_json(run_dir, {"name": run_dir.name, "world_size": RANKS})
    for rank in range(RANKS):
        sink = ParquetSink(run_dir / METRICS_DIR, rank, flush_interval_s=3600)
        records = StepRecords()
        for step in range(0, STEPS, every):
            names = ["demo/step/loss", "demo/step/lr"]
            records.add("t", step, rank, names, [float(loss[rank, step]), 1e-3], 1000.0 + step)
        sink.write(records)
        sink.close()
    return run_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("bands") / "run", values(0))


def expected(loss: np.ndarray, first: int, size: int, steps: np.ndarray) -> dict[int, tuple]:
    """bucket start -> (mean, low, high, records), by numpy over every rank's points."""
    out = {}
    start_of = first + (steps - first) // size * size
    for start in np.unique(start_of):
        points = loss[:, steps[start_of == start]]
        out[int(start)] = (points.mean(), points.min(), points.max(), points.size)
    return out


def test_every_point_is_inside_its_bucket_and_the_bands_match_numpy(run):
    grid = Grid.spanning(0, STEPS - 1)
    with RunStore(run) as store:
        series = read_series(store, grid)
    loss = series["", "demo/step/loss"]
    assert grid.size == 26 and len(loss.steps) == grid.columns <= MAX_COLUMNS
    truth = expected(values(0), 0, grid.size, np.arange(STEPS))
    assert sorted(truth) == loss.steps.tolist()
    got = np.column_stack([loss.mean, loss.low, loss.high])
    want = np.array([truth[s][:3] for s in sorted(truth)])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert loss.records == sum(t[3] for t in truth.values()) == RANKS * STEPS
    # Each recorded point, rank by rank, lies in the band of its bucket.
    column = np.arange(STEPS) // grid.size
    assert np.all(values(0) >= loss.low[column]) and np.all(values(0) <= loss.high[column])
    assert loss.total == pytest.approx(values(0).sum())


def test_a_spike_on_one_rank_survives_downsampling(run):
    grid = Grid.spanning(0, STEPS - 1)
    with RunStore(run) as store:
        loss = read_series(store, grid)["", "demo/step/loss"]
    bucket = SPIKE[1] // grid.size
    assert loss.high[bucket] == SPIKE[2]
    assert loss.high.max() == SPIKE[2] and np.argmax(loss.high) == bucket


def test_a_gap_stays_a_gap_and_sparse_metrics_keep_their_own_buckets(tmp_path):
    run_dir = write(tmp_path / "sparse", values(1), every=1000)  # steps 0, 1000, ...
    grid = Grid.spanning(0, STEPS - 1)
    with RunStore(run_dir) as store:
        loss = read_series(store, grid)["", "demo/step/loss"]
    steps = np.arange(0, STEPS, 1000)
    assert loss.steps.tolist() == (steps // grid.size * grid.size).tolist()
    np.testing.assert_allclose(loss.mean, values(1)[:, steps].mean(axis=0))


def test_bands_by_run_over_a_store_of_several(tmp_path, run):
    other = write(tmp_path / "other", values(2))
    grid = Grid(first=100, last=5_099, size=50)
    with RunStore([run, other]) as store:
        series = read_series(store, grid, where="step BETWEEN 100 AND 5099", by_run=True)
    assert sorted(k for k in series if k[1] == "demo/step/loss") == [
        ("other", "demo/step/loss"),
        ("run", "demo/step/loss"),
    ]
    steps = np.arange(100, 5_100)
    for run_id, seed in (("run", 0), ("other", 2)):
        truth = expected(values(seed), 100, 50, steps)
        s = series[run_id, "demo/step/loss"]
        np.testing.assert_allclose(s.high, [truth[b][2] for b in sorted(truth)], rtol=1e-12)
        np.testing.assert_allclose(s.mean, [truth[b][0] for b in sorted(truth)], rtol=1e-12)


# From 64 steps a bucket on, the grid is aligned to a rollup width: (5, 1_000_004) would
# be 2,500 steps from step 5; it is 2,560 (a multiple of 256) from step 0.
@pytest.mark.parametrize(("first", "last", "start", "size", "width"), [
    (0, 0, 0, 1, None), (0, 399, 0, 1, None), (0, 400, 0, 2, None), (-10, 10, -10, 1, None),
    (0, 25_599, 0, 64, 64), (100, 25_699, 64, 128, 64), (5, 1_000_004, 0, 2560, 256),
    (-1_000, 100_000, -1_024, 256, 256), (0, 9_999_999, 0, 25_600, 1_024),
])  # fmt: skip
def test_the_grid_fits_any_span_in_the_column_budget(first, last, start, size, width):
    grid = Grid.spanning(first, last)
    assert (grid.first, grid.size, grid.rollup_width) == (start, size, width)
    assert grid.columns <= MAX_COLUMNS
    # The last step falls in the last column, the first in the first.
    assert (last - grid.first) // grid.size == grid.columns - 1
    assert (first - grid.first) // grid.size == 0
    if width is not None:  # the bucket grew by at most an eighth, or stays within 2x
        assert grid.size * (1 - 1 / 8) < math.ceil((last - first + 1) / MAX_COLUMNS) * 2
