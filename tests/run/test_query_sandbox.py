"""Queries are read-only and see only the run: every escape is refused, by the CLI and
the Python API, and nothing outside the run is read or written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_store_helpers import make_run, write_shards

import syncless.run.store as store_module
from syncless.capture import CapturedRecord, SafetensorsSink
from syncless.cli import main
from syncless.errors import UsageError
from syncless.run import open as open_run

SECRET = "hunter2-not-for-queries"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = make_run(tmp_path / "run")
    write_shards(run, rank=0, shards=[[0, 1, 2], [3, 4]])  # 10 records
    (tmp_path / "secret.csv").write_text(f"token\n{SECRET}\n")
    return run


def escapes(tmp_path: Path, run_dir: Path) -> dict[str, str]:
    """Each escape from the issue (and a few more), by name: the SQL that tries it."""
    secret = tmp_path / "secret.csv"
    out = tmp_path / "out"
    return {
        "read_csv": f"SELECT * FROM read_csv('{secret}')",
        "file_as_table": f"SELECT * FROM '{secret}'",
        "read_text": f"SELECT * FROM read_text('{secret}')",
        "glob": f"SELECT * FROM glob('{tmp_path}/*')",
        "copy_out": f"COPY (SELECT * FROM metrics) TO '{out}.csv'",
        "copy_into_metrics": (
            f"COPY (SELECT * FROM metrics) TO '{run_dir}/metrics/planted.parquet' (FORMAT parquet)"
        ),
        "attach": f"ATTACH '{out}.db'",
        "export": f"EXPORT DATABASE '{out}'",
        "import": f"IMPORT DATABASE '{tmp_path}'",
        "install": "INSTALL httpfs",
        "load": "LOAD httpfs",
        "set": "SET enable_external_access = true",
        "pragma": "PRAGMA enable_profiling",
        "create": "CREATE TABLE t AS SELECT 1",
        "insert": "INSERT INTO metrics SELECT * FROM metrics",
        "update": "UPDATE metrics SET value = 0",
        "delete": "DELETE FROM metrics",
        "drop": "DROP TABLE metrics",
        "call": "CALL duckdb_settings()",
        "explain_analyze_copy": f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{out}.csv'",
        "two_statements": f"SELECT 1; COPY (SELECT 1) TO '{out}.csv'",
        "pivot_without_in": "PIVOT metrics ON name USING sum(value)",
    }


def files_under(path: Path) -> set[Path]:
    return set(path.rglob("*"))


ESCAPES = list(escapes(Path("/x"), Path("/y")))
# The ones that touch the file system: refused by the connection itself too.
FILE_ESCAPES = [
    "read_csv",
    "file_as_table",
    "read_text",
    "glob",
    "copy_out",
    "copy_into_metrics",
    "attach",
    "export",
    "install",
    "load",
    "set",
]


@pytest.mark.parametrize("name", ESCAPES)
def test_each_escape_is_refused_by_the_python_api(tmp_path, run_dir, name):
    sql = escapes(tmp_path, run_dir)[name]
    before = files_under(tmp_path)
    with open_run(run_dir) as store:
        with pytest.raises(UsageError, match=r"^query (refused|failed)") as caught:
            store.query(sql)
        assert SECRET not in str(caught.value)
        assert store.query("SELECT count(*) FROM metrics")[1] == [(10,)]
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("name", ESCAPES)
def test_each_escape_is_refused_by_the_cli(tmp_path, run_dir, name, capsys):
    sql = escapes(tmp_path, run_dir)[name]
    before = files_under(tmp_path)
    assert main(["query", str(run_dir), sql]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(("syncless: error: query refused", "syncless: error: query failed"))
    assert "Traceback" not in err and SECRET not in err
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("name", FILE_ESCAPES)
def test_the_connection_refuses_file_access_without_the_statement_check(
    tmp_path, run_dir, name, monkeypatch
):
    # The statement check is the polite refusal; with it gone, the connection is the wall.
    monkeypatch.setattr(store_module, "check_query", lambda sql: None)
    sql = escapes(tmp_path, run_dir)[name]
    before = files_under(tmp_path)
    with open_run(run_dir) as store:
        with pytest.raises(UsageError) as caught:
            store.query(sql)
        assert SECRET not in str(caught.value)
        with pytest.raises(UsageError, match="query refused: it reaches outside the run"):
            store.query(escapes(tmp_path, run_dir)["read_csv"])  # still walled in
    assert files_under(tmp_path) == before


def test_a_planted_shard_is_never_read(tmp_path, run_dir):
    sql = escapes(tmp_path, run_dir)["copy_into_metrics"]
    with open_run(run_dir) as store, pytest.raises(UsageError):
        store.query(sql)
    with open_run(run_dir) as store:
        assert store.query("SELECT count(*) FROM metrics")[1] == [(10,)]
        assert sorted(p.name for p in store.shards) == [
            "rank00000-000001-000001.s0_2.n6.parquet",
            "rank00000-000002-000002.s3_4.n4.parquet",
        ]


def test_the_escapes_are_refused_through_a_real_process(tmp_path, run_dir):
    for name in ("read_csv", "copy_out"):
        sql = escapes(tmp_path, run_dir)[name]
        done = subprocess.run(
            [sys.executable, "-m", "syncless.cli", "query", str(run_dir), sql],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert done.stdout == ""
        assert done.stderr.startswith("syncless: error: query refused"), done.stderr
        assert "Traceback" not in done.stderr and SECRET not in done.stderr
    assert not (tmp_path / "out.csv").exists() and not (tmp_path / "out.db").exists()


def test_read_only_queries_still_work(run_dir, capsys):
    with open_run(run_dir) as store:
        assert store.tables == ["metrics", "metrics_rollups", "metrics_unrolled",
                                "metrics_written", "runs"]  # fmt: skip
        assert store.query("SELECT count(*) FROM metrics")[1] == [(10,)]
        assert store.query("WITH s AS (SELECT DISTINCT step FROM metrics) FROM s ORDER BY 1")[
            1
        ] == [(0,), (1,), (2,), (3,), (4,)]
        assert [r[0] for r in store.query("DESCRIBE metrics")[1]] == [
            *("run", "step", "rank", "name", "value", "time")
        ]
        pivot = "PIVOT metrics ON name IN ('test/step/m1') USING max(value) GROUP BY step"
        assert store.query(pivot + " ORDER BY step LIMIT 2")[1] == [(0, 0.1), (1, 1.1)]
        assert store.query("SHOW TABLES")[1] == [("metrics",), ("metrics_rollups",),
            ("metrics_unrolled",), ("metrics_written",), ("runs",)]  # fmt: skip
        assert store.sql("SELECT sum(value) FROM metrics").fetchall() == [
            (pytest.approx(sum(step + i / 10 for step in range(5) for i in range(2))),)
        ]
    assert (
        main(["query", str(run_dir), "SELECT count(*) AS n FROM metrics", "--format", "csv"]) == 0
    )
    assert capsys.readouterr().out.splitlines() == ["n", "10"]


def test_captures_are_a_table_where_the_run_has_captures(tmp_path, run_dir, capsys):
    sink = SafetensorsSink(run_dir, rank=0)
    tensors = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + i for i in range(3)]
    sink.write(
        [
            CapturedRecord(
                i,
                f"layer_0{i}/hidden",
                10 + i,
                0,
                (2, 3),
                t.dtype,
                24,
                None,
                t.view(-1).view(torch.uint8),
            )
            for i, t in enumerate(tensors)
        ]
    )
    with open_run(run_dir) as store:
        assert store.tables == ["captures", "metrics", "metrics_rollups", "metrics_unrolled",
                                "metrics_written", "runs"]  # fmt: skip
        _, rows = store.query("SELECT tag, step, shape, dtype FROM captures ORDER BY seq")
    assert rows == [(f"layer_0{i}/hidden", 10 + i, [2, 3], "float32") for i in range(3)]
    assert main(["query", str(run_dir), "SELECT count(*) FROM captures", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "3"
