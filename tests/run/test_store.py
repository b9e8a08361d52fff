import pytest

from syncless.errors import UsageError
from syncless.run import Run
from syncless.run import open as open_run


def test_empty_run_answers_with_no_rows(tmp_path):
    run = Run(run_dir=tmp_path / "r", flush_interval_s=3600)
    with open_run(tmp_path / "r") as store:
        cols, rows = store.query("SELECT * FROM metrics")
    assert cols == ["run", "step", "rank", "name", "value", "time"]
    assert rows == []
    run.close()


def test_store_sees_shards_written_after_open(tmp_path):
    run = Run(run_dir=tmp_path / "r")
    store = open_run(tmp_path / "r")
    run.log(0, {"a/b/c": 1.0})
    run.flush()
    assert store.query("SELECT count(*) FROM metrics")[1] == [(1,)]
    run.close()
    store.close()


def test_not_a_run_directory(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        open_run(tmp_path / "missing")
    with pytest.raises(UsageError, match="is not a syncless run"):
        open_run(tmp_path)
    (tmp_path / "run.json").write_text('{"format": "something-else"}')
    with pytest.raises(UsageError, match="not a syncless run file"):
        open_run(tmp_path)


def test_sql_errors_are_usage_errors(tmp_path):
    Run(run_dir=tmp_path / "r").close()
    with open_run(tmp_path / "r") as store:
        with pytest.raises(UsageError, match="query failed"):
            store.query("SELEC nonsense")
        with pytest.raises(UsageError, match="query failed"):
            store.query("SELECT no_such_column FROM metrics")


def test_the_query_path_spells_the_shard_schema_as_the_writer_does():
    """store.METRICS_COLUMNS keeps pyarrow off the query path; it must say what
    parquet.SCHEMA says, in DuckDB's types."""
    from syncless.run.parquet import SCHEMA
    from syncless.run.store import METRICS_COLUMNS

    duckdb_type = {"string": "VARCHAR", "int64": "BIGINT", "int32": "INTEGER", "double": "DOUBLE"}
    assert tuple((f.name, duckdb_type[str(f.type)]) for f in SCHEMA) == METRICS_COLUMNS
