"""Compaction (issue #37): every record readable exactly once, before, during and after
a merge, whatever kills the compactor; the names are the manifest.

Ground truth is the multiset of records read straight from the shards with pyarrow
before anything is merged (the store is not asked what it holds)."""

from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from run_store_helpers import make_run, truncate, write_shards

from syncless.cli import main
from syncless.run import ParquetSink, StepRecord
from syncless.run import open as open_run
from syncless.run.compact import compact_rank, compact_run
from syncless.run.shards import list_folder, parse

COLUMNS = ["rank", "step", "name", "value"]


def records_on_disk(metrics: Path) -> collections.Counter:
    """Every record of every shard file, read with pyarrow: the truth before a merge."""
    out: collections.Counter = collections.Counter()
    for path in metrics.glob("*.parquet"):
        table = pq.read_table(path, columns=COLUMNS).to_pylist()
        out.update(tuple(r[c] for c in COLUMNS) for r in table)
    return out


def records_in_store(run: Path) -> collections.Counter:
    with open_run(run) as store:
        _, rows = store.query(f"SELECT {', '.join(COLUMNS)} FROM metrics")
    return collections.Counter(rows)


def buckets(records: collections.Counter) -> dict[tuple, tuple]:
    """(rank, name, step // 64) -> (records, low, high, sum) of ``records``."""
    out: dict[tuple, list] = {}
    for (rank, step, name, value), n in records.items():
        got = out.setdefault((rank, name, step // 64), [0, value, value, 0.0])
        got[0] += n
        got[1], got[2] = min(got[1], value), max(got[2], value)
        got[3] += n * value
    return {k: (v[0], v[1], v[2], round(v[3], 6)) for k, v in out.items()}


def buckets_in_store(run: Path) -> dict[tuple, tuple]:
    """The same, through the shards' rollups where they have one, and their records
    where not: what a report reads."""
    with open_run(run) as store:
        _, rows = store.query(
            "SELECT rank, name, step // 64, sum(records), min(low), max(high), sum(total) FROM "
            "(SELECT rank, name, step, records, low, high, total FROM metrics_rollups "
            "WHERE width = 64 UNION ALL SELECT rank, name, step, 1, value, value, value "
            "FROM metrics_unrolled) GROUP BY ALL"
        )
    return {tuple(r[:3]): (r[3], r[4], r[5], round(r[6], 6)) for r in rows}


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """3 ranks x 12 shards of 2-3 steps x 4 names."""
    run = make_run(tmp_path / "run", world_size=3)
    for rank in range(3):
        write_shards(run, rank, [[2 * i, 2 * i + 1] + [99] * (i % 2) for i in range(12)], names=4)
    return run


def test_compaction_keeps_every_record_once_in_fewer_files(run):
    metrics = run / "metrics"
    truth = records_on_disk(metrics)
    assert sum(truth.values()) == 3 * (12 * 8 + 6 * 4)
    stats = compact_run(run, target_rows=40)
    files = sorted(p.name for p in metrics.glob("*.parquet"))
    assert (stats.shards_before, stats.shards_after) == (36, len(files))
    assert len(files) < 36 and not list_folder(metrics).covered
    assert records_on_disk(metrics) == truth == records_in_store(run)
    for name in files:  # what a name says is what the file holds
        shard = parse(name)
        steps = pq.read_table(metrics / name, columns=["step"])["step"].to_pylist()
        assert (shard.rows, shard.first_step, shard.last_step) == (
            len(steps),
            min(steps),
            max(steps),
        )


def test_a_merge_never_spans_a_gap_or_an_unreadable_shard(run):
    metrics = run / "metrics"
    rank0 = sorted(metrics.glob("rank00000-*.parquet"))
    rank0[4].unlink()  # number 5 lost
    truncate(rank0[8])  # number 9 unreadable
    stats = compact_rank(metrics, 0, target_rows=10_000)
    ranges = sorted(
        (s.first_seq, s.last_seq) for _, s in list_folder(metrics).visible if s.rank == 0
    )
    assert ranges == [(1, 4), (6, 8), (9, 9), (10, 12)]
    assert [f.split(":")[0] for f in stats.failed] == [rank0[8].name]
    with open_run(run) as store:
        # shards of 8 records (4 names x 2 steps), the odd-numbered i 4 more: 120 in all;
        # numbers 5 and 9 (i = 4 and 8: 8 records each) are gone
        assert store.query("SELECT count(*) FROM metrics WHERE rank = 0")[1] == [(120 - 8 - 8,)]
        assert [s.path.name for s in store.unreadable] == [rank0[8].name]


def test_a_query_plans_from_the_names_without_opening_a_footer(run, monkeypatch):
    def no_footer(*args, **kwargs):
        raise AssertionError("a footer was read")

    monkeypatch.setattr(pq, "read_metadata", no_footer)
    monkeypatch.setattr(pq, "ParquetFile", no_footer)
    with open_run(run) as store:
        assert store.query("SELECT count(*) FROM metrics")[1] == [(3 * 120,)]
        assert sum(s.rows for s in store.shards.values()) == 3 * 120


# -- killed at any point ---------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import syncless.run.compact as compact

    kill_at = int(sys.argv[2])
    calls = [0]

    def counted(real):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return call

    compact.os.replace = counted(os.replace)  # the merged shard appears
    Path.unlink = counted(Path.unlink)  # an input goes
    compact.compact_run(sys.argv[1], target_rows=40)
    print(calls[0])
    """
)


def _compact_in_child(run: Path, kill_at: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(run), str(kill_at)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_sigkill_at_every_rename_and_delete_loses_and_doubles_nothing(run, tmp_path):
    """Killed at each rename (a merged shard or its rollup appears) and each delete (an
    input goes) in turn, on a fresh copy of the run each time: the records, and the
    buckets read through rollups, are the truth's."""
    truth = records_on_disk(run / "metrics")
    points = int(_compact_in_child(shutil.copytree(run, tmp_path / "probe"), 0).stdout)
    assert points == 3 * (3 * 2 + 12)  # per rank: 3 merged shards (and rollups) of 4 inputs
    for kill_at in range(1, points + 1):
        copy = shutil.copytree(run, tmp_path / f"killed-{kill_at}")
        done = _compact_in_child(copy, kill_at)
        assert done.returncode == -signal.SIGKILL, done.stderr
        assert records_in_store(copy) == truth, f"killed at call {kill_at}"
        assert buckets_in_store(copy) == buckets(truth), f"killed at call {kill_at}"
        compact_run(copy, target_rows=40)  # the next compaction finishes and sweeps
        assert records_in_store(copy) == truth and not list_folder(copy / "metrics").covered
        listing = list_folder(copy / "metrics")
        assert not listing.stray_rollups and len(listing.rollups) == len(listing.visible)
        assert buckets_in_store(copy) == buckets(truth)
        shutil.rmtree(copy)


def test_a_sigkill_at_a_random_moment_loses_and_doubles_nothing(tmp_path):
    run = make_run(tmp_path / "run", world_size=4)
    for rank in range(4):
        write_shards(run, rank, [[i] for i in range(60)], names=50)
    truth = records_on_disk(run / "metrics")
    rng = random.Random(0)
    for _ in range(6):
        child = subprocess.Popen(
            [sys.executable, "-c",
             f"import syncless.run.compact as c; c.compact_run({str(run)!r}, target_rows=400)"],
        )  # fmt: skip
        try:
            child.wait(timeout=rng.uniform(0.5, 2.5))  # import ~0.5 s, then merges
        except subprocess.TimeoutExpired:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        assert records_in_store(run) == truth
    compact_run(run, target_rows=400)
    assert records_in_store(run) == truth


# -- in a live run, and by hand --------------------------------------------------------------


def test_a_live_writer_compacts_its_own_shards(tmp_path):
    run = make_run(tmp_path / "run")
    sink = ParquetSink(run / "metrics", 0, flush_interval_s=3600, compact_every=4)
    for step in range(10):
        sink.write([StepRecord("t", step, 0, f"test/step/m{i}", float(i), 0.0) for i in range(3)])
        sink.flush()
    sink.close()
    ranges = sorted((s.first_seq, s.last_seq) for _, s in list_folder(run / "metrics").visible)
    assert ranges == [(1, 8), (9, 9), (10, 10)]  # merged at the 4th and the 8th shard
    with open_run(run) as store:
        assert store.query("SELECT count(*), count(DISTINCT step) FROM metrics")[1] == [(30, 10)]
    resumed = ParquetSink(run / "metrics", 0, flush_interval_s=3600)
    assert resumed._seq == 11  # past every number a merged shard covers
    resumed.close()


def test_the_command_compacts_a_finished_run(run, capsys):
    assert main(["compact", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("syncless compact: 36 shards -> 3 (360 records rewritten")
    assert "3 rollups written" in out
    assert main(["compact", str(run.parent)]) == 2  # not a run directory
    assert "syncless: error:" in capsys.readouterr().err


def test_check_reads_every_footer_against_its_name(run, capsys):
    metrics = run / "metrics"
    first = sorted(metrics.glob("rank00001-*.parquet"))[0]
    shard = parse(first.name)
    wrong = shard.name.replace(f".n{shard.rows}.", f".n{shard.rows + 1}.")
    first.rename(metrics / wrong)
    assert main(["check", str(run)]) == 1
    assert (
        f"its name says {shard.rows + 1} rows, the file holds {shard.rows}"
        in capsys.readouterr().out
    )
