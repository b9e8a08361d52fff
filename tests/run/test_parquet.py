import time

import pyarrow.parquet as pq
import pytest

from syncless.run import ParquetSink, StepRecord, StepRecords


def _records(n: int, rank: int = 0, step0: int = 0) -> list[StepRecord]:
    return [
        StepRecord("r", step0 + i, rank, f"test/step/m{i % 3}", i * 0.5, 1000.0 + i)
        for i in range(n)
    ]


def _read_all(metrics_dir) -> list[tuple]:
    rows = []
    for path in sorted(metrics_dir.glob("*.parquet")):
        rows += [tuple(r.values()) for r in pq.read_table(path).to_pylist()]
    return rows


def test_records_round_trip_exactly(tmp_path):
    sink = ParquetSink(tmp_path, rank=3)
    written = _records(250, rank=3)
    sink.write(written[:100])
    sink.write(written[100:])
    sink.close()
    expected = [(r.run, r.step, r.rank, r.name, r.value, r.time) for r in written]
    assert _read_all(tmp_path) == expected
    assert all(p.name.startswith("rank00003-") for p in tmp_path.glob("*.parquet"))


def test_column_records_round_trip_exactly_and_read_like_tuples(tmp_path):
    """StepRecords chunks (several steps, runs and ranks, single appends mixed in) land
    in Parquet row for row as the tuples they stand for."""
    expected = []
    columns = StepRecords()
    for step in range(4):
        names = [f"test/layer_{i:02d}/m" for i in range(step + 1)]
        values = [step + i / 8 for i in range(step + 1)]
        columns.add(f"run{step % 2}", step, step % 3, names, values, 100.0 + step)
        expected += [(f"run{step % 2}", step, step % 3, n, v, 100.0 + step)
                     for n, v in zip(names, values, strict=True)]  # fmt: skip
        one = StepRecord("solo", step, 7, "test/step/x", -1.5, 5.0)
        columns.append(one)
        expected.append(tuple(one))
    assert len(columns) == len(expected)
    assert [tuple(r) for r in columns] == expected
    assert tuple(columns[5]) == expected[5] and tuple(columns[-1]) == expected[-1]
    sink = ParquetSink(tmp_path, rank=0)
    sink.write(columns)
    sink.write(_records(3))  # plain tuples into the same shard
    sink.close()
    expected += [tuple(r) for r in _records(3)]
    assert _read_all(tmp_path) == expected
    with pytest.raises(ValueError, match="2 names for 1 values"):
        StepRecords().add("r", 0, 0, ["a/b/c", "a/b/d"], [1.0], 0.0)


def test_flush_writes_a_shard_now_and_interval_batches(tmp_path):
    sink = ParquetSink(tmp_path, rank=0, flush_interval_s=3600)
    sink.write(_records(5))
    time.sleep(0.1)
    assert list(tmp_path.glob("*.parquet")) == []  # batched, not written per call
    sink.flush()
    assert len(list(tmp_path.glob("*.parquet"))) == 1
    sink.close()


def test_interval_flush_without_explicit_flush(tmp_path):
    sink = ParquetSink(tmp_path, rank=0, flush_interval_s=0.05)
    sink.write(_records(7))
    deadline = time.monotonic() + 5
    while not list(tmp_path.glob("*.parquet")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(_read_all(tmp_path)) == 7
    sink.close()


def test_no_temporary_files_left_and_resume_does_not_overwrite(tmp_path):
    first = ParquetSink(tmp_path, rank=0)
    first.write(_records(3))
    first.close()
    second = ParquetSink(tmp_path, rank=0)
    second.write(_records(4, step0=100))
    second.close()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    # rank, sequence number, steps and rows: the manifest in the name
    assert sorted(p.name for p in tmp_path.glob("*.parquet")) == [
        "rank00000-000001-000001.s0_2.n3.parquet",
        "rank00000-000002-000002.s100_103.n4.parquet",
    ]
    assert len(_read_all(tmp_path)) == 7


def test_writer_error_surfaces_on_the_callers_thread(tmp_path):
    sink = ParquetSink(tmp_path, rank=0)
    bad = StepRecord("r", 0, 0, "test/step/x", "not a number", 0.0)  # type: ignore[arg-type]
    sink.write([bad])
    with pytest.raises(RuntimeError, match="Parquet writer for rank 0 failed"):
        sink.flush()
    sink.close()
