"""An unreadable shard does not take the run with it: queries read every other shard and
warn once per bad one by name; strict mode fails with the same message."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from run_store_helpers import make_run, truncate, write_shards

from syncless.cli import main
from syncless.errors import UsageError
from syncless.run import Run
from syncless.run import open as open_run
from syncless.run.store import UnreadableShardError

STORE_LOG = "syncless.run.store"


@pytest.fixture
def run_dir(tmp_path: Path) -> tuple[Path, Path]:
    """A run of three shards written by Run (steps 0-1, 2-3, 4), the middle one truncated."""
    run = Run(run_dir=tmp_path / "run", flush_interval_s=3600)
    for steps in ([0, 1], [2, 3], [4]):
        for step in steps:
            run.log(step, {"test/step/loss": float(step), "test/step/lr": 0.1})
        run.flush()
    run.close()
    shards = sorted((tmp_path / "run" / "metrics").glob("*.parquet"))
    assert len(shards) == 3
    truncate(shards[1])
    return tmp_path / "run", shards[1]


def warnings_about(caplog, path: Path) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == STORE_LOG and str(path) in r.getMessage()
    ]


def test_queries_read_every_readable_shard_and_warn_once_per_bad_one(run_dir, caplog):
    run, bad = run_dir
    caplog.set_level(logging.WARNING, logger=STORE_LOG)
    with open_run(run) as store:
        for _ in range(3):
            _, rows = store.query("SELECT step, name, value FROM metrics ORDER BY step, name")
        assert [s.path for s in store.unreadable] == [bad]
        assert "Parquet magic bytes not found" in store.unreadable[0].error
    assert rows == [
        (step, name, value)
        for step in (0, 1, 4)
        for name, value in (("test/step/loss", float(step)), ("test/step/lr", 0.1))
    ]
    (message,) = warnings_about(caplog, bad)
    assert message.startswith(f"skipped unreadable shard {bad}: Parquet magic bytes")


def test_strict_raises_a_syncless_error_that_names_the_shard(run_dir):
    run, bad = run_dir
    with pytest.raises(UnreadableShardError) as caught:
        open_run(run, strict=True)
    assert isinstance(caught.value, UsageError)
    assert caught.value.path == bad
    assert str(caught.value).startswith(f"unreadable shard {bad}: Parquet magic bytes")


def test_a_shard_that_goes_bad_after_open_is_reported_too(tmp_path, caplog):
    run = make_run(tmp_path / "run")
    write_shards(run, rank=0, shards=[[0, 1]])
    caplog.set_level(logging.WARNING, logger=STORE_LOG)
    with open_run(run) as store:
        (late,) = write_shards(run, rank=1, shards=[[0, 1]])
        truncate(late)
        (good,) = write_shards(run, rank=2, shards=[[0]])
        assert store.query("SELECT rank, count(*) FROM metrics GROUP BY rank ORDER BY rank")[1] == [
            (0, 4),
            (2, 2),
        ]
        assert [s.path for s in store.unreadable] == [late]
        assert store.shards[good].rows == 2
    assert len(warnings_about(caplog, late)) == 1


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "Parquet file size is 0 bytes"),
        (b"not parquet at all, just some bytes", "Parquet magic bytes not found"),
        ("other_table", "not a metrics shard: run is missing; rank is string"),
    ],
)
def test_files_that_are_not_metrics_shards_are_unreadable(tmp_path, content, reason):
    run = make_run(tmp_path / "run")
    write_shards(run, rank=0, shards=[[0, 1]])
    odd = run / "metrics" / "odd.parquet"
    if content == "other_table":
        pq.write_table(pa.table({"step": [1], "rank": ["zero"]}), odd)
    else:
        odd.write_bytes(content)
    with open_run(run, strict=False) as store:
        assert store.query("SELECT count(*) FROM metrics")[1] == [(4,)]
        (shard,) = store.unreadable
    assert shard.path == odd and shard.error.startswith(reason)
    with pytest.raises(UnreadableShardError, match=reason):
        open_run(run, strict=True)


def test_a_shard_corrupt_past_its_footer_is_found_and_skipped(tmp_path):
    run = make_run(tmp_path / "run")
    _, middle, _ = write_shards(run, rank=0, shards=[[0], [1, 2, 3], [4]], names=500)
    with middle.open("r+b") as f:  # the footer stays whole: only reading the data finds it
        f.seek(100)
        f.write(bytes(range(256)) * 8)
    assert pq.read_metadata(middle).num_rows == 1500
    with open_run(run) as store:
        assert store.query("SELECT DISTINCT step FROM metrics ORDER BY step")[1] == [(0,), (4,)]
        assert [s.path for s in store.unreadable] == [middle]


def test_the_cli_warns_once_per_shard_on_stderr_and_strict_exits_1(run_dir, capsys):
    run, bad = run_dir
    assert main(["query", str(run), "SELECT count(*) AS n FROM metrics", "--format", "csv"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == ["n", "6"]
    assert err.splitlines() == [
        f"syncless: warning: skipped unreadable shard {bad}: Parquet magic bytes not found in "
        "footer. Either the file is corrupted or this is not a parquet file. "
        "(strict=True or --strict fails instead)"
    ]
    assert main(["query", str(run), "SELECT count(*) FROM metrics", "--strict"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"syncless: error: unreadable shard {bad}: Parquet magic bytes not found in footer. "
        "Either the file is corrupted or this is not a parquet file."
    ]


def test_the_warning_reaches_stderr_of_a_real_process(run_dir):
    run, bad = run_dir
    # A shard is checked when a query meets it (its name is its manifest): this one does.
    done = subprocess.run(
        [sys.executable, "-m", "syncless.cli", "query", str(run), "SELECT count(*) FROM metrics"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0
    assert done.stderr.count("\n") == 1 and f"skipped unreadable shard {bad}" in done.stderr
