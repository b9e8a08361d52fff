"""Read a run directory back: read-only SQL over every rank's shards.

Opening a run plans its shards from one listing of each folder (the names are the
manifest: syncless.run.shards) and makes each table a view over its files: ``metrics``
and, where the run has captures, ``captures`` (their index). The connection may read
the run's shard files and nothing else (DuckDB's ``allowed_paths``, then external
access off and the settings locked); a query must be one SELECT. Start at :class:`RunStore`; the user's view is in ``docs/run.md``
("Queries").
"""

from __future__ import annotations

import fnmatch
import logging
import os
from typing import TYPE_CHECKING, Any, NamedTuple

import pyarrow as pa

from syncless.errors import UsageError
from syncless.run.parquet import SCHEMA
from syncless.run.rundir import METRICS_DIR, read_run_json
from syncless.run.shards import catalogue
from syncless.run.storage import (
    RunPath,
    exists,
    is_remote,
    list_files,
    read_metadata,
    read_table,
    run_path,
)

if TYPE_CHECKING:
    import duckdb

__all__ = ["RunStore", "Shard", "UnreadableShardError", "check_query", "open"]

log = logging.getLogger(__name__)

# table -> (folder in the run directory, shard file pattern). "captures" is
# syncless.capture.sink.CAPTURES_DIR, spelled out here: that module imports torch.
TABLES = {"metrics": (METRICS_DIR, "*.parquet"), "captures": ("captures", "rank*-*.parquet")}

_DUCKDB_TYPES = {"string": "VARCHAR", "int64": "BIGINT", "int32": "INTEGER", "double": "DOUBLE"}
_METRICS_COLUMNS = ", ".join(f.name for f in SCHEMA)

# Settings fixed at connect. The run's folders are allowed, then external access goes
# off and the settings lock, in RunStore.__init__.
_CONFIG = {
    "python_enable_replacements": False,  # SQL must not see the caller's Python variables
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "temp_directory": "",  # no spill files: a query never writes to disk
}
# Connections a store keeps after a newer one replaced it (their relations stay readable).
_OLD_CONNECTIONS = 8
# A query that meets a shard it cannot read drops the shard and runs again, this often.
_MAX_RETRIES = 8
# Errors of the query itself: never a shard's fault.
_QUERY_ERRORS = ("BinderException", "ParserException", "CatalogException", "ConversionException",
                 "OutOfRangeException", "InvalidTypeException", "NotImplementedException",
                 "ConstraintException", "SyntaxException", "TypeMismatchException")  # fmt: skip

_ALLOWED = "one read-only SELECT (or WITH, FROM, DESCRIBE, SHOW, SUMMARIZE)"


class UnreadableShardError(UsageError):
    """A shard that could not be read, with ``strict=True`` (``--strict``).

    ``path`` is the shard; the message names it and says why.
    """

    def __init__(self, message: str, path: RunPath) -> None:
        super().__init__(message)
        self.path = path


class Shard(NamedTuple):
    """One Parquet file a table is read from."""

    path: RunPath
    table: str  # "metrics" or "captures"
    rows: int  # rows it holds; 0 when unreadable
    error: str | None  # why it could not be read; None when it was


def check_query(sql: str) -> None:
    """Raise UsageError unless ``sql`` is exactly one read-only SELECT statement.

    The check reads DuckDB's own parse of the statement. It is the polite first
    refusal; the wall is the connection, which has no file access at all.
    """
    import duckdb

    try:
        statements = duckdb.extract_statements(sql)
        kinds = [s.type.name for s in statements]
    except duckdb.Error as e:
        raise UsageError(f"query failed: {e}") from None
    except ValueError:  # a statement type this duckdb's Python enum does not name
        raise UsageError(f"query refused: queries are {_ALLOWED}") from None
    if not kinds:
        raise UsageError(
            'empty query: pass one SELECT statement, e.g. "SELECT count(*) FROM metrics"'
        )
    if len(kinds) > 1:
        raise UsageError(f"query refused: {len(kinds)} statements; queries are {_ALLOWED}")
    if kinds[0] == "MULTI":  # what DuckDB makes of a PIVOT without IN (...)
        raise UsageError(
            "query refused: a PIVOT must list its columns, e.g. "
            "PIVOT metrics ON name IN ('demo/step/loss', 'demo/step/lr') USING avg(value)"
        )
    if kinds[0] != "SELECT":
        raise UsageError(f"query refused: {kinds[0]} is not a SELECT; queries are {_ALLOWED}")


class RunStore:
    """A run directory opened for read-only SQL.

    Tables: ``metrics`` (``run, step, rank, name, value, time``: every rank's step
    records) and, when the run has captures, ``captures`` (their index), each a view
    over the shard files. Every query first lists the folders again, so a live run (and
    one being compacted) can be queried. A shard that cannot be read is skipped with one
    warning each (``strict=True`` raises :class:`UnreadableShardError` instead): shards
    named before the manifest are checked by their footer when first listed, the others
    when a query meets them. Statements other than SELECT are refused, and the
    connection reads only this run's shard files.

    Example::

        with syncless.run.open("runs/20261130-101500-demo-tiny") as store:
            columns, rows = store.query("SELECT rank, count(*) FROM metrics GROUP BY rank")
            df = store.sql("SELECT * FROM metrics").df()

    Args:
        path: the run directory (it holds ``run.json``).
        strict: raise on the first unreadable shard instead of skipping it.
        warn: log a warning (``syncless.run.store``) per skipped shard.
    """

    def __init__(self, path: str | os.PathLike, *, strict: bool = False, warn: bool = True) -> None:
        self.path = run_path(path)
        self.strict = strict
        self.warn = warn
        self.info: dict[str, Any] = _read_info(self.path)
        #: Every shard of the latest listing, readable or not, by path.
        self.shards: dict[RunPath, Shard] = {}
        self._views: dict[str, list[str]] = {}  # table -> the real paths its view reads
        self._read_whole: set[RunPath] = set()  # shards read whole without an error
        self._real_folders: dict[RunPath, str] = {}  # folder -> its real path and a separator
        self._listings: dict[str, list[str]] = {}  # table -> its folder's names, last listed
        # Imported here: training processes write shards and never need DuckDB.
        import duckdb

        self._duckdb = duckdb
        self._con: duckdb.DuckDBPyConnection | None = None
        self._allowed: set[str] = set()
        # Earlier connections, kept while relations they returned may still be read.
        self._old: list[duckdb.DuckDBPyConnection] = []
        try:
            self.refresh()
            if strict:  # every shard checked now, not when a query meets it
                self.verify()
        except BaseException:
            self.close()
            raise

    def _connect(self, files: set[str]) -> None:
        """A connection that may read exactly ``files`` (DuckDB's ``allowed_paths``),
        then no other file: external access off, settings locked. Views, not tables: a
        query reads only the row groups it needs, where loading every shard first cost
        ~1.5 ms a shard on every query (issue #37). A live run's new shards need a new
        connection (the allowed paths are fixed once access is off): ~5 ms."""
        con = self._duckdb.connect(":memory:", config=_CONFIG)
        try:
            if is_remote(self.path):  # DuckDB reads the store through fsspec, as we do
                con.register_filesystem(self.path.fs)
            # A bound list, not a literal: parsing 1,024 quoted paths cost 8-40 ms.
            con.execute("SET allowed_paths = $1", [sorted(files)])
            # Footers read once per connection: a report runs dozens of queries.
            con.execute("SET parquet_metadata_cache = true")
            con.execute("SET enable_external_access = false")
            con.execute("SET lock_configuration = true")
        except BaseException:
            con.close()
            raise
        if self._con is not None:
            self._old = [*self._old[-(_OLD_CONNECTIONS - 1) :], self._con]
        self._con, self._allowed, self._views = con, set(files), {}

    @property
    def tables(self) -> list[str]:
        """The tables a query can read."""
        rows = self._con.execute(
            "SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY 1"
        ).fetchall()
        return [r[0] for r in rows]

    @property
    def unreadable(self) -> list[Shard]:
        """Shards skipped because they could not be read."""
        return [s for s in self.shards.values() if s.error is not None]

    def refresh(self) -> list[Shard]:
        """List the folders again and point the views at what they hold now; return the
        shards not seen before."""
        listings = {table: list_files(self.path / TABLES[table][0]) for table in TABLES}
        if listings == self._listings:
            # Nothing written, renamed or deleted since: the plan stands (planning
            # 1,024 ranks' names again cost 9 ms of a 60 ms count(*)).
            return []
        self._listings = listings
        known = {(s.table, s.path.name): s for s in self.shards.values()}
        self.shards = {}
        new: list[Shard] = []
        files: dict[str, list[str]] = {}  # table -> its readable shards' real paths
        for table in TABLES:
            folder = self.path / TABLES[table][0]
            real = self._real_folder(folder)
            files[table] = []
            for name, rows in _shards_of(table, listings[table]):
                shard = known.get((table, name))
                if shard is None:  # new: a Path and, without a manifest name, a footer
                    path = folder / name
                    found = (rows, None) if rows is not None else _inspect(table, path)
                    shard = Shard(path, table, *found)
                    new.append(shard)
                    if shard.error is not None:
                        self._report(shard)
                self.shards[shard.path] = shard
                if shard.error is None:
                    files[table].append(real + name)
        if self._con is None or not all(self._allowed.issuperset(f) for f in files.values()):
            self._connect({f for table_files in files.values() for f in table_files})
        for table, table_files in files.items():
            if self._views.get(table) != table_files:
                self._view(table, table_files)
        return new

    def sql(self, query: str) -> duckdb.DuckDBPyRelation:
        """Run one SELECT and return its rows as a DuckDB relation (``.fetchall()``,
        ``.df()``, ...).

        Raises UsageError for invalid SQL, for a statement that is not a SELECT and for
        a query that reaches for a file.
        """
        check_query(query)
        self.refresh()
        for _ in range(_MAX_RETRIES):
            try:
                # Run now, not when the caller fetches: a shard that cannot be read is
                # found here, dropped, and the query runs again without it.
                return self._con.sql(query).materialize()
            except self._duckdb.PermissionException as e:
                raise UsageError(
                    f"query refused: it reaches outside the run ({_first_line(e)}); "
                    f"queries read only the tables {', '.join(self.tables)}"
                ) from None
            except self._duckdb.Error as e:
                if type(e).__name__ in _QUERY_ERRORS or not (
                    self._drop_culprit(e) or self._find_unreadable()
                ):
                    raise UsageError(f"query failed: {e}") from None
        raise UsageError(f"query failed: more than {_MAX_RETRIES} shards could not be read")

    def query(self, query: str) -> tuple[list[str], list[tuple]]:
        """Run one SELECT and return (column names, rows)."""
        rel = self.sql(query)
        try:
            return list(rel.columns), rel.fetchall()
        except self._duckdb.Error as e:
            raise UsageError(f"query failed: {e}") from None

    def close(self) -> None:
        for con in [*self._old, self._con]:
            if con is not None:
                con.close()
        self._old, self._con = [], None

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _real_folder(self, folder: RunPath) -> str:
        """``folder`` resolved, once a store, with a trailing separator: DuckDB checks
        allowed paths by their real name (resolving each of 2,048 files cost 85 ms). An
        object store's URL is its real name."""
        real = self._real_folders.get(folder)
        if real is None:
            real = f"{folder}/" if is_remote(folder) else f"{folder.resolve()}{os.sep}"
            self._real_folders[folder] = real
        return real

    def _real(self, path: RunPath) -> str:
        return self._real_folder(path.parent) + path.name

    def _view(self, table: str, files: list[str]) -> None:
        self._views[table] = files
        if not files:
            if table == "metrics":  # empty, with the schema: queries still bind
                columns = ", ".join(
                    f"NULL::{_DUCKDB_TYPES[str(f.type)]} AS {f.name}" for f in SCHEMA
                )
                self._con.execute(f"CREATE OR REPLACE VIEW metrics AS SELECT {columns} WHERE false")
                self._con.execute(
                    f"CREATE OR REPLACE VIEW metrics_written AS SELECT {columns}, "
                    "NULL::VARCHAR AS file, NULL::BIGINT AS row WHERE false"
                )
            else:
                self._con.execute(f"DROP VIEW IF EXISTS {table}")
            return
        paths = ", ".join(_sql_string(f) for f in files)
        if table == "metrics":
            # Write order, for readers that need it (the summary's name order, the
            # trace's nesting): shard names sort by rank and sequence number, and
            # compaction keeps each shard's rows in the order they were written.
            # ``metrics`` is its projection: one file list to parse and bind (a second
            # cost 12 ms on 1,024 files), and the virtual columns cost nothing where a
            # query does not ask for them.
            statements = [
                f"CREATE OR REPLACE VIEW metrics_written AS SELECT {_METRICS_COLUMNS}, "
                "filename AS file, file_row_number AS row "
                f"FROM read_parquet([{paths}], filename = true, file_row_number = true)",
                f"CREATE OR REPLACE VIEW metrics AS SELECT {_METRICS_COLUMNS} FROM metrics_written",
            ]
        else:  # the capture index grew columns over versions
            statements = [
                f"CREATE OR REPLACE VIEW {table} AS "
                f"SELECT * FROM read_parquet([{paths}], union_by_name = true)"
            ]
        try:
            for statement in statements:
                self._con.execute(statement)
        except self._duckdb.Error as e:  # binding reads the first file: it may be bad
            if not self._drop_culprit(e):
                raise

    def verify(self) -> list[Shard]:
        """Read every shard's footer (``syncless check``): what the names say is
        checked against the files. Returns the shards found unreadable."""
        bad = []
        for path, shard in list(self.shards.items()):
            if shard.error is not None:
                continue
            rows, error = _inspect(shard.table, path)
            if error is None and shard.table == "metrics" and rows != shard.rows:
                error = f"its name says {shard.rows} rows, the file holds {rows}"
            if error is not None:
                bad.append(self._unreadable(shard, error))
        return bad

    def _drop_culprit(self, error: BaseException) -> bool:
        """Mark the shard ``error`` names unreadable (or gone: listed again) and point
        the views past it; False when the error names none of the run's shards."""
        text = str(error)
        for path, shard in list(self.shards.items()):
            if shard.error is None and self._real(path) in text:
                if not exists(path):  # compacted away since the listing
                    self.refresh()
                    return True
                # pyarrow's reason where the footer is bad (what `check` says), else DuckDB's
                reason = _inspect(shard.table, path)[1] or _first_line(error)
                self._unreadable(shard, reason)
                return True
        return False

    def _find_unreadable(self) -> bool:
        """A query failed without naming a file (a page corrupt past the footer): read
        each shard whole to find the bad ones (costly, and only on such a failure)."""
        found = False
        for path, shard in list(self.shards.items()):
            if shard.error is not None or path in self._read_whole:
                continue
            try:
                read_table(path)
            except (OSError, pa.ArrowException) as e:
                self._unreadable(shard, _first_line(e))
                found = True
            else:
                self._read_whole.add(path)
        return found

    def _unreadable(self, shard: Shard, reason: str) -> Shard:
        bad = self.shards[shard.path] = Shard(shard.path, shard.table, 0, reason)
        self._report(bad)
        readable = [
            self._real(p)
            for p, s in self.shards.items()
            if s.table == shard.table and s.error is None
        ]
        self._view(shard.table, readable)
        return bad

    def _report(self, shard: Shard) -> None:
        message = f"unreadable shard {shard.path}: {shard.error}"
        if self.strict:
            raise UnreadableShardError(message, shard.path)
        if self.warn:
            log.warning("skipped %s (strict=True or --strict fails instead)", message)


def open(path: str | os.PathLike, *, strict: bool = False) -> RunStore:
    """Open a run directory for queries: ``syncless.run.open("runs/...").sql("...")``."""
    return RunStore(path, strict=strict)


def _read_info(path: RunPath) -> dict[str, Any]:
    """``run.json``, or a one-line UsageError for a path that is not a run directory."""
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{str(path)!r} is a file, not a run directory")
        return read_run_json(path)
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or _first_line(e)
        raise UsageError(f"cannot read run directory {str(path)!r}: {reason}") from None


def _shards_of(table: str, names: list[str]) -> list[tuple[str, int | None]]:
    """The table's shard files among a folder's ``names``, with their rows where the
    name says them (metrics shards; no file is opened)."""
    if table != "metrics":
        return [(name, None) for name in sorted(fnmatch.filter(names, TABLES[table][1]))]
    listing = catalogue(names)
    # Another name in the folder is read as a shard of unknown rows (a copy, a rename by
    # hand): its footer decides.
    odd = [n for n in listing.other if n.endswith(".parquet") and not n.startswith(".")]
    return [(name, s.rows) for name, s in listing.visible] + [(n, None) for n in odd]


def _inspect(table: str, path: RunPath) -> tuple[int, str | None]:
    """Rows and error of a shard from its footer alone: catches truncated files cheaply
    (0.05 ms a shard), and a metrics shard whose columns are not the schema."""
    try:
        meta = read_metadata(path)
        schema = meta.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as e:
        return 0, _first_line(e)
    if table == "metrics":
        types = dict(zip(schema.names, schema.types, strict=True))
        problems = [
            f"{f.name} is missing" if f.name not in types else f"{f.name} is {types[f.name]}"
            for f in SCHEMA
            if types.get(f.name) != f.type
        ]
        if problems:
            return 0, f"not a metrics shard: {'; '.join(problems)}"
    return meta.num_rows, None


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
