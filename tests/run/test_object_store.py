"""A run directory in an object store (S3 through moto's local server): written by
``Run``, read by the store and every command, its sandbox confined to the run's prefix."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from moto_s3 import S3, moto_s3

from syncless.cli import main
from syncless.errors import UsageError
from syncless.run import ParquetSink, Run, StepRecord
from syncless.run import open as open_run
from syncless.run.compact import STALE_LOCK_S, compact_rank
from syncless.run.shards import parse, rollup_name
from syncless.run.storage import run_path

pytest.importorskip("upath", reason='run directories in S3 need pip install "syncless[fsspec]"')


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    """moto's S3, configured the way a user configures fsspec: the endpoint in the
    environment (for the commands run as processes) and in fsspec's config (this one)."""
    import fsspec

    with moto_s3(monkeypatch, prefix="runs") as server:
        monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", server.endpoint)
        monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": server.endpoint})
        yield server


def fs(server: S3):
    import fsspec

    return fsspec.filesystem("s3", **server.options)


def log_steps(run: Run, steps: range, names: int = 3) -> collections.Counter:
    """Log ``names`` metrics per step, flushing every 5 steps; the records, counted."""
    logged: collections.Counter = collections.Counter()
    for step in steps:
        values = {f"test/step/m{i}": step * 10.0 + i for i in range(names)}
        run.log(step, values)
        logged.update((run.ranks.rank, step, k, v) for k, v in values.items())
        if step % 5 == 4:
            run.flush()
    return logged


def stored(url: str) -> collections.Counter:
    with open_run(url) as store:
        rows = store.query("SELECT rank, step, name, value FROM metrics")[1]
    return collections.Counter(rows)


def shard_names(server: S3, url: str) -> list[str]:
    folder = url.removeprefix("s3://") + "/metrics"
    return sorted(p.rsplit("/", 1)[-1] for p in fs(server).ls(folder, refresh=True))


def test_a_run_writes_to_s3_and_reads_back_every_record_once(s3: S3) -> None:
    url = f"s3://{s3.bucket}/runs/a"
    with Run(run_dir=url, config={"lr": 0.1}, flush_interval_s=3600) as run:
        assert str(run.dir) == url and run.name == "a"
        logged = log_steps(run, range(20))
    assert stored(url) == logged
    meta = json.loads(fs(s3).cat_file(f"{s3.bucket}/runs/a/run.json"))
    assert meta["segments"][0]["config"] == {"lr": 0.1}
    assert meta["segments"][0]["first_step"] == 0
    # One object per flush, named by its manifest: rank, sequence, steps, rows.
    names = shard_names(s3, url)
    assert [parse(n).first_step for n in names] == [0, 5, 10, 15]
    assert all(parse(n).rows == 15 for n in names)


def test_a_generated_name_under_an_s3_root_and_a_refused_second_run(s3: S3) -> None:
    root = f"s3://{s3.bucket}/team"
    with Run(name="job", root=root) as first:
        first.log(0, {"test/step/x": 1.0})
    with Run(name="job", root=root) as second:  # the same second: a -2 suffix
        second.log(0, {"test/step/x": 2.0})
    for run, value in ((first, 1.0), (second, 2.0)):
        assert str(run.dir).startswith(f"{root}/") and run.name.split("-")[2] == "job"
        assert stored(str(run.dir)) == collections.Counter([(0, 0, "test/step/x", value)])
    assert first.dir != second.dir
    with pytest.raises(UsageError, match="already holds a run"):
        Run(run_dir=str(first.dir))


def test_a_resumed_s3_run_continues_after_its_last_stored_step(s3: S3) -> None:
    url = f"s3://{s3.bucket}/runs/resumed"
    with Run(run_dir=url, flush_interval_s=3600) as run:
        logged = log_steps(run, range(12))
    with Run(run_dir=url, resume=True, flush_interval_s=3600) as run:
        assert run.next_step == 12
        logged += log_steps(run, range(12, 20))
    assert stored(url) == logged
    meta = json.loads(fs(s3).cat_file(f"{s3.bucket}/runs/resumed/run.json"))
    assert [s["first_step"] for s in meta["segments"]] == [0, 12]
    # The second segment's shards continue the sequence numbers: none overwritten.
    assert len(shard_names(s3, url)) == 3 + 2


def test_the_sandbox_reads_this_run_and_nothing_else_in_the_bucket(s3: S3) -> None:
    url = f"s3://{s3.bucket}/runs/mine"
    with Run(run_dir=url) as run:
        run.log(0, {"test/step/x": 1.0})
    secret = f"{s3.bucket}/runs/other/metrics/secret.parquet"
    with fs(s3).open(secret, "wb") as f:
        pq.write_table(pa.table({"x": [42]}), f)
    with open_run(url) as store:
        assert store.query("SELECT value FROM metrics")[1] == [(1.0,)]
        for reach in (f"s3://{secret}", "/etc/passwd", f"s3://{s3.bucket}/runs/mine/run.json"):
            with pytest.raises(UsageError, match="query refused"):
                store.query(f"SELECT * FROM read_parquet('{reach}')")


def test_every_command_takes_an_s3_run(s3: S3, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("plotly")
    url = f"s3://{s3.bucket}/runs/cli"
    with Run(run_dir=url, flush_interval_s=3600) as run:
        logged = log_steps(run, range(30))
    # The commands as a user runs them: a process, the endpoint from the environment.
    query = subprocess.run(
        [sys.executable, "-m", "syncless.cli", "query", url,
         "SELECT count(*) AS n, sum(value) AS total FROM metrics", "--format", "json"],
        capture_output=True, text=True, timeout=120, env=os.environ,
    )  # fmt: skip
    assert query.returncode == 0, query.stderr
    got = json.loads(query.stdout)
    assert got[0]["n"] == len(logged)
    assert got[0]["total"] == pytest.approx(sum(k[3] for k in logged))

    assert main(["summary", url]) == 0
    summary = capsys.readouterr().out
    assert "0..29 (30 with records)" in summary and f"records      {len(logged)}" in summary
    assert main(["check", url]) == 0
    assert "healthy" in capsys.readouterr().out
    assert main(["report", url]) == 0
    assert f"{url}/report.html" in capsys.readouterr().out
    assert fs(s3).cat_file(f"{url}/report.html").startswith(b"<!DOCTYPE html>")

    before = len(shard_names(s3, url))
    assert main(["compact", url]) == 0
    merged = "rank00000-000001-000006.s0_29.n90"  # and its rollup, an object beside it
    assert before == 6 and shard_names(s3, url) == [f"{merged}.parquet", f"{merged}.rollup"]
    assert stored(url) == logged


def test_a_corrupt_object_is_skipped_by_name_and_check_finds_it(
    s3: S3, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{s3.bucket}/runs/torn"
    with Run(run_dir=url, flush_interval_s=3600) as run:
        logged = log_steps(run, range(10))
    bad = shard_names(s3, url)[0]
    path = f"{url}/metrics/{bad}"
    fs(s3).pipe_file(path, fs(s3).cat_file(path)[:50])  # a copy cut short
    with open_run(url) as store:
        rows = store.query("SELECT rank, step, name, value FROM metrics")[1]
        assert [str(s.path) for s in store.unreadable] == [path]
    assert collections.Counter(rows) == collections.Counter(k for k in logged if k[1] >= 5)
    assert main(["check", url]) == 1
    out = capsys.readouterr().out
    assert "unhealthy" in out and bad in out


def test_live_compaction_in_s3_keeps_every_record_once(s3: S3) -> None:
    url = f"s3://{s3.bucket}/runs/live"
    folder = run_path(url) / "metrics"
    sink = ParquetSink(folder, rank=0, flush_interval_s=3600, compact_every=4)
    expected = collections.Counter()
    for shard in range(10):
        records = [StepRecord("t", step, 0, "test/step/x", float(step), 0.0)
                   for step in range(shard * 3, shard * 3 + 3)]  # fmt: skip
        sink.write(records)
        sink.flush()
        expected.update((0, r.step, r.name, r.value) for r in records)
    sink.close()
    assert sink.compaction_errors == 0
    names = shard_names(s3, url)
    shards = [n for n in names if n.endswith(".parquet")]
    assert [(parse(n).first_seq, parse(n).last_seq) for n in shards] == [(1, 8), (9, 9), (10, 10)]
    assert sorted(set(names) - set(shards)) == [rollup_name(shards[0])]  # the merged one's
    fs(s3).pipe_file(f"{s3.bucket}/runs/live/run.json", b'{"format": "syncless-run/1"}')
    assert stored(url) == expected


def test_a_held_lock_in_s3_skips_the_rank_and_a_stale_one_is_taken_over(s3: S3) -> None:
    url = f"s3://{s3.bucket}/runs/locked"
    with Run(run_dir=url, flush_interval_s=3600) as run:
        logged = log_steps(run, range(15))
    folder = run_path(url) / "metrics"
    lock = f"{s3.bucket}/runs/locked/metrics/.compact-rank00000.lock"
    held = {"host": "elsewhere", "pid": 1, "time": time.time()}
    fs(s3).pipe_file(lock, json.dumps(held).encode())
    assert compact_rank(folder, 0).busy_ranks == 1
    assert len(shard_names(s3, url)) == 3 + 1  # the lock is an object too

    held["time"] = time.time() - STALE_LOCK_S - 1  # its holder died long ago
    fs(s3).pipe_file(lock, json.dumps(held).encode())
    stats = compact_rank(folder, 0)
    assert stats.busy_ranks == 0 and stats.shards_after == 1
    merged = "rank00000-000001-000003.s0_14.n45"  # the shard and its rollup; the lock gone
    assert shard_names(s3, url) == [f"{merged}.parquet", f"{merged}.rollup"]
    assert stored(url) == logged


def test_an_unknown_protocol_is_one_clear_line() -> None:
    with pytest.raises(UsageError, match="nosuchfs://b/x"):
        Run(run_dir="nosuchfs://b/x")


def test_only_an_object_store_url_is_remote(tmp_path) -> None:
    from pathlib import Path

    from upath import UPath

    from syncless.run.storage import is_remote

    local = [str(tmp_path), f"file://{tmp_path}", UPath(f"file://{tmp_path}"), UPath(tmp_path)]
    for given in local:
        path = run_path(given)
        assert type(path) is type(Path()) and path == tmp_path and not is_remote(path)
    for url in ("s3://bucket/runs/x", "memory://runs/x"):
        path = run_path(url)
        assert is_remote(path) and str(path) == url
        assert run_path(path) is path  # a UPath keeps its storage options
