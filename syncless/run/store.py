"""Read a run directory back: DuckDB over the Parquet shards of every rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from syncless.errors import UsageError
from syncless.run.parquet import SCHEMA
from syncless.run.rundir import METRICS_DIR, read_run_json

if TYPE_CHECKING:
    import duckdb

_DUCKDB_TYPES = {"string": "VARCHAR", "int64": "BIGINT", "int32": "INTEGER", "double": "DOUBLE"}


class RunStore:
    """A run directory opened for queries.

    ``metrics`` is a DuckDB view over all ranks' shards with columns
    ``run, step, rank, name, value, time``. Shards written after ``open`` are seen by
    later queries (the view globs at query time).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.info: dict[str, Any] = read_run_json(self.path)
        # Imported here: training processes write shards and never need DuckDB.
        import duckdb

        self._duckdb_error = duckdb.Error
        self.con = duckdb.connect(":memory:")
        self.con.execute(self._metrics_view_sql())

    def _metrics_view_sql(self) -> str:
        shards = self.path / METRICS_DIR
        if any(shards.glob("*.parquet")):
            glob = str(shards / "*.parquet").replace("'", "''")
            return f"CREATE OR REPLACE VIEW metrics AS SELECT * FROM read_parquet('{glob}')"
        # A run that has not flushed yet still answers queries, with no rows.
        cols = ", ".join(f"CAST(NULL AS {_DUCKDB_TYPES[str(f.type)]}) AS {f.name}" for f in SCHEMA)
        return f"CREATE OR REPLACE VIEW metrics AS SELECT {cols} WHERE false"

    def sql(self, query: str) -> duckdb.DuckDBPyRelation:
        """Run ``query`` and return the DuckDB relation (``.fetchall()``, ``.df()``, ...).

        Raises UsageError with DuckDB's message when the SQL is invalid.
        """
        self.con.execute(self._metrics_view_sql())  # pick up shards written since open
        try:
            return self.con.sql(query)
        except self._duckdb_error as e:
            raise UsageError(f"query failed: {e}") from None

    def query(self, query: str) -> tuple[list[str], list[tuple]]:
        """Run ``query`` and return (column names, rows)."""
        rel = self.sql(query)
        if rel is None:  # a statement without a result (e.g. CREATE VIEW)
            return [], []
        try:
            return list(rel.columns), rel.fetchall()
        except self._duckdb_error as e:
            raise UsageError(f"query failed: {e}") from None

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open(path: str | os.PathLike) -> RunStore:
    """Open a run directory for queries: ``syncless.run.open("runs/...").sql("...")``."""
    return RunStore(path)
