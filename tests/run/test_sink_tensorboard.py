"""TensorBoardSink: read back with TensorBoard's own reader, checked against the records."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from syncless.run import Run, StepRecord, TensorBoardSink
from syncless.run import open as open_run
from syncless.run.records import step_records

HEADS = [f"monitors/layer_00/attn_qk_logit_max/head_{h}" for h in range(4)]
EXPERTS = [f"monitors/global/moe_tokens_count/expert_{e}" for e in range(3)]


def read_events(logdir: Path) -> EventAccumulator:
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events


def lagged_batches(rng: np.random.Generator) -> list[list[StepRecord]]:
    """Each step's loss with the previous step's monitor vectors, as a monitor lags one
    step; a straggler for step 0 comes last."""
    batches = []
    for step in range(4):
        batch = [StepRecord("r", step, 0, "train/step/loss", float(rng.normal()), 100.0 + step)]
        if step > 0:
            lag = step - 1
            batch += step_records("r", lag, 0, HEADS, rng.normal(size=4).tolist(), 200.0 + lag)
            batch += step_records("r", lag, 0, EXPERTS, rng.integers(0, 9, 3).tolist(), 300.0)
        batches.append(batch)
    batches.append([StepRecord("r", 0, 0, "train/step/late_ms", 7.25, 400.0)])
    return batches


def test_every_record_is_a_scalar_at_its_step_and_wall_time_lagged_ones_included(tmp_path):
    batches = lagged_batches(np.random.default_rng(0))
    with Run(run_dir=tmp_path / "r", sinks=[TensorBoardSink(tmp_path / "tb")]) as run:
        for batch in batches:
            run.emit(batch)
    expected: dict[str, list[tuple[int, float, float]]] = {}
    for r in (r for batch in batches for r in batch):
        expected.setdefault(r.name, []).append((r.step, np.float32(r.value), r.time))
    events = read_events(tmp_path / "tb")
    assert set(events.Tags()["scalars"]) == set(expected)
    for name, points in expected.items():
        got = [(e.step, np.float32(e.value), e.wall_time) for e in events.Scalars(name)]
        assert sorted(got) == sorted(points), name
    assert run.sink_errors == {}


def test_a_vector_family_at_one_step_is_one_histogram_under_its_prefix(tmp_path):
    batches = lagged_batches(np.random.default_rng(1))
    sink = TensorBoardSink(tmp_path / "tb")
    for batch in batches:
        sink.write(batch)
    sink.close()
    events = read_events(tmp_path / "tb")
    for family, prefix in ((HEADS, HEADS[0].rsplit("/", 1)[0]), (EXPERTS, EXPERTS[0].rsplit("/", 1)[0])):  # fmt: skip
        histograms = {e.step: e for e in events.Histograms(prefix)}
        assert sorted(histograms) == [0, 1, 2]
        for step, event in histograms.items():
            values = np.array([r.value for b in batches for r in b if r.step == step and r.name in family])  # fmt: skip
            h = event.histogram_value
            assert (h.num, h.min, h.max) == (len(family), values.min(), values.max())
            assert h.sum == pytest.approx(values.sum(), rel=1e-12)
            assert sum(h.bucket) == len(family)
            assert event.wall_time == next(r.time for b in batches for r in b if r.name == family[0] and r.step == step)  # fmt: skip
    assert set(events.Tags()["histograms"]) == {HEADS[0].rsplit("/", 1)[0], EXPERTS[0].rsplit("/", 1)[0]}  # fmt: skip


class BrokenWriter:
    def __init__(self, logdir: str, **kwargs: object) -> None:
        pass

    def add_scalar(self, *args: object, **kwargs: object) -> None:
        raise OSError("event file on fire")

    def close(self) -> None:
        pass


def test_a_writer_that_raises_is_counted_and_never_breaks_the_step(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink._writer_class = BrokenWriter
    run = Run(run_dir=tmp_path / "r", sinks=[sink])
    for step in range(3):
        run.log(step, {"train/step/loss": float(step)})  # never raises
    run.close()  # the writer thread's error surfaces here at the latest
    assert run.sink_errors["TensorBoardSink"] >= 1
    with open_run(tmp_path / "r") as store:
        _, rows = store.query("SELECT step FROM metrics WHERE name = 'train/step/loss'")
    assert sorted(rows) == [(0,), (1,), (2,)]


def test_a_writer_that_cannot_open_disables_the_sink_after_one_counted_error(tmp_path):
    (tmp_path / "tb").write_text("a file where the event directory should be")
    run = Run(run_dir=tmp_path / "r", sinks=[TensorBoardSink(tmp_path / "tb")])
    for step in range(5):
        run.log(step, {"train/step/loss": float(step)})
    run.close()
    assert run.sink_errors == {"TensorBoardSink": 1}


def test_demo_sink_tensorboard_writes_rank_zero_records_under_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    syncless = Path(sys.executable).parent / "syncless"
    argv = [syncless, "demo", "--steps", "3", "--run-dir", run_dir, "--quiet", "--sink", "tensorboard"]  # fmt: skip
    subprocess.run(argv, check=True, timeout=300)
    with open_run(run_dir) as store:  # the Parquet shards are the ground truth
        _, rows = store.query("SELECT name, step, value FROM metrics WHERE name LIKE 'demo/%'")
    events = read_events(run_dir / "tensorboard")
    got = {(name, e.step, np.float32(e.value)) for name in events.Tags()["scalars"]
           for e in events.Scalars(name) if name.startswith("demo/")}  # fmt: skip
    assert got == {(name, step, np.float32(value)) for name, step, value in rows}
    assert {step for _, step, _ in got} == {0, 1, 2}
