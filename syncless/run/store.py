"""Read run directories back: read-only SQL over every rank's shards, of one run or many.

Opening a run plans its shards from one listing of each folder (the names are the
manifest: syncless.run.shards) and makes each table a view over its files: ``metrics``
and, where the run has captures, ``captures`` (their index), and a table ``runs`` (one
row per run: syncless.run.runset). A store of several runs reads them as one: its
views add each run's id as ``run``. The connection may read the runs' shard files and
nothing else (DuckDB's ``allowed_paths``, then external access off and the settings
locked); a query must be one SELECT. Start at :class:`RunStore`; the user's view is in
``docs/run.md`` ("Queries").
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from syncless.errors import UsageError
from syncless.run.rundir import METRICS_DIR, read_run_json
from syncless.run.runset import RunEntry, find_runs, runs_table
from syncless.run.shards import Catalogue, catalogue, parse
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

__all__ = ["RunStore", "Shard", "UnreadableShardError", "check_query", "open", "open_runs",
           "sql_string"]  # fmt: skip

log = logging.getLogger(__name__)

# table -> (folder in the run directory, shard file pattern). "captures" is
# syncless.capture.sinks.shards.CAPTURES_DIR, spelled out here: that module imports torch.
TABLES = {"metrics": (METRICS_DIR, "*.parquet"), "captures": ("captures", "rank*-*.parquet")}

# syncless.run.parquet.SCHEMA in DuckDB's types, spelled out: that module imports
# pyarrow, 90 ms that a query does not need (tests/run/test_store.py checks they agree).
METRICS_COLUMNS = (("run", "VARCHAR"), ("step", "BIGINT"), ("rank", "INTEGER"),
                   ("name", "VARCHAR"), ("value", "DOUBLE"), ("time", "DOUBLE"))  # fmt: skip
_COLUMNS = ", ".join(name for name, _ in METRICS_COLUMNS)
_DATA_COLUMNS = ", ".join(name for name, _ in METRICS_COLUMNS[1:])  # without run
# syncless.run.rollups.SCHEMA, spelled out for the same reason (the same test checks).
ROLLUP_COLUMNS = (("width", "INTEGER"), ("run", "VARCHAR"), ("name", "VARCHAR"),
                  ("rank", "INTEGER"), ("step", "BIGINT"), ("first_step", "BIGINT"),
                  ("last_step", "BIGINT"), ("low", "DOUBLE"), ("high", "DOUBLE"),
                  ("total", "DOUBLE"), ("records", "BIGINT"))  # fmt: skip
_ROLLUP_DATA = ", ".join(name for name, _ in ROLLUP_COLUMNS if name != "run")
# The views a store keeps over its metrics shards, beside ``metrics``: the rollups of the
# readable visible shards that have one, and the records of those that have none. A query
# that reads both (syncless.report.bands) counts every record once.
ROLLUP_VIEWS = ("metrics_rollups", "metrics_unrolled")

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
    run: str = ""  # the id of its run (RunStore.runs)


def check_query(sql: str) -> None:
    """Raise UsageError unless ``sql`` is exactly one read-only SELECT statement.

    The check reads DuckDB's own parse of the statement. It is the polite first
    refusal; the wall is the connection, which has no file access at all.
    """
    kinds = _statement_kinds(sql)
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


@functools.lru_cache(maxsize=256)
def _statement_kinds(sql: str) -> tuple[str, ...]:
    """The kinds of ``sql``'s statements, as DuckDB parses them. Cached: the CLI checks
    a query before opening the run and the store checks it again (15 ms a parse)."""
    import duckdb

    try:
        return tuple(s.type.name for s in duckdb.extract_statements(sql))
    except duckdb.Error as e:
        raise UsageError(f"query failed: {e}") from None
    except ValueError:  # a statement type this duckdb's Python enum does not name
        raise UsageError(f"query refused: queries are {_ALLOWED}") from None


class Extent(NamedTuple):
    """What a store's metrics span: None where no shard (or its footer) says."""

    first_step: int | None
    last_step: int | None
    ranks: list[int]
    first_time: float | None  # seconds since the epoch
    last_time: float | None


class RunStore:
    """Run directories opened for read-only SQL: one run, or several read as one.

    Tables: ``metrics`` (``run, step, rank, name, value, time``: every rank's step
    records), ``runs`` (one row per run: id, name, path, start, world size, commit and
    every config field) and, when a run has captures, ``captures`` (their index). The
    record tables are views over the shard files. Every query first lists the folders
    again, so a live run (and one being compacted) can be queried. A shard that cannot
    be read is skipped with one warning each (``strict=True`` raises
    :class:`UnreadableShardError` instead): shards named before the manifest are checked
    by their footer when first listed, the others when a query meets them. Statements
    other than SELECT are refused, and the connection reads only the runs' shard files.

    Over several runs (``paths`` a list, :func:`open_runs`), ``metrics.run`` and
    ``captures.run`` hold each record's run id, the key of ``runs``. Over one run,
    ``metrics.run`` is what its writer stored (the directory name, for ``Run``).

    Two more views split ``metrics`` for readers that want it summed by step bucket
    (syncless.report.bands): ``metrics_rollups``, the rollups of the visible shards that
    have one (syncless.run.rollups; ``file`` names each row's rollup), and
    ``metrics_unrolled``, the records of the shards that have none. A rollup that cannot
    be read is left out (``bad_rollups``; a warning each) and its shard read instead.

    Example::

        with syncless.run.open("runs/20261130-101500-demo-tiny") as store:
            columns, rows = store.query("SELECT rank, count(*) FROM metrics GROUP BY rank")
            df = store.sql("SELECT * FROM metrics").df()
        with syncless.run.open_runs(["runs"]) as store:  # every run under runs/
            store.query("SELECT run, min(value) FROM metrics WHERE name = 'demo/step/loss' "
                        "GROUP BY run ORDER BY 2")

    Args:
        path: the run directory (it holds ``run.json``); or a list of run directories
            and folders holding runs (syncless.run.runset).
        strict: raise on the first unreadable shard instead of skipping it.
        warn: log a warning (``syncless.run.store``) per skipped shard.
    """

    def __init__(
        self,
        path: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        strict: bool = False,
        warn: bool = True,
    ) -> None:
        self.strict = strict
        self.warn = warn
        if isinstance(path, str | os.PathLike):
            #: The run directory; None for a store of several runs.
            self.path: RunPath | None = run_path(path)
            self.runs = [RunEntry(self.path.name, self.path, _read_info(self.path))]
        else:
            self.path = None
            #: The runs read, in order: id (``metrics.run``), directory, ``run.json``.
            self.runs = find_runs(list(path))
        #: Every shard of the latest listing, readable or not, by path.
        self.shards: dict[RunPath, Shard] = {}
        #: Visible shards' rollups, by shard path (unreadable ones left out).
        self.rollups: dict[RunPath, RunPath] = {}
        #: Rollups that could not be read: path -> why (their shards are read instead).
        self.bad_rollups: dict[RunPath, str] = {}
        #: Rollups of the latest listing whose shard is covered or gone: ignored.
        self.stray_rollups: list[RunPath] = []
        self._views: dict[str, list[tuple[str, str]]] = {}  # table -> (run, real path) it reads
        self._read_whole: set[RunPath] = set()  # shards read whole without an error
        self._real_folders: dict[RunPath, str] = {}  # folder -> its real path and a separator
        self._listings: dict[tuple[str, str], list[str]] = {}  # (run, table) -> names listed
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

    @property
    def several(self) -> bool:
        """Whether this store reads several runs (``metrics.run`` is then the run id)."""
        return self.path is None

    @property
    def info(self) -> dict[str, Any]:
        """The run's ``run.json``. A store of several runs has one per run: ``runs``."""
        if self.several:
            raise UsageError(
                f"this store reads {len(self.runs)} runs: each run's run.json is in "
                "store.runs[i].info"
            )
        return self.runs[0].info

    def _connect(self, files: set[str]) -> None:
        """A connection that may read exactly ``files`` (DuckDB's ``allowed_paths``),
        then no other file: external access off, settings locked. Views, not tables: a
        query reads only the row groups it needs, where loading every shard first cost
        ~1.5 ms a shard on every query (issue #37). A live run's new shards need a new
        connection (the allowed paths are fixed once access is off): ~5 ms."""
        con = self._duckdb.connect(":memory:", config=_CONFIG)
        try:
            registered = set()
            for run in self.runs:  # DuckDB reads an object store through fsspec, as we do
                if is_remote(run.path) and id(run.path.fs) not in registered:
                    con.register_filesystem(run.path.fs)
                    registered.add(id(run.path.fs))
            # A bound list, not a literal: parsing 1,024 quoted paths cost 8-40 ms.
            con.execute("SET allowed_paths = $1", [sorted(files)])
            # Footers read once per connection: a report runs dozens of queries.
            con.execute("SET parquet_metadata_cache = true")
            con.execute("SET enable_external_access = false")
            con.execute("SET lock_configuration = true")
            _create_runs_table(con, self.runs)
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
            "SELECT view_name FROM duckdb_views() WHERE NOT internal "
            "UNION SELECT table_name FROM duckdb_tables() WHERE NOT internal ORDER BY 1"
        ).fetchall()
        return [r[0] for r in rows]

    @property
    def unreadable(self) -> list[Shard]:
        """Shards skipped because they could not be read."""
        return [s for s in self.shards.values() if s.error is not None]

    def refresh(self) -> list[Shard]:
        """List the folders again and point the views at what they hold now; return the
        shards not seen before."""
        listings = {
            (run.id, table): list_files(run.path / TABLES[table][0])
            for run in self.runs
            for table in TABLES
        }
        if listings == self._listings:
            # Nothing written, renamed or deleted since: the plan stands (planning
            # 1,024 ranks' names again cost 9 ms of a 60 ms count(*)).
            return []
        self._listings = listings
        known = {(s.table, s.path): s for s in self.shards.values()}
        self.shards = {}
        rollups: dict[RunPath, RunPath] = {}
        self.stray_rollups = []
        new: list[Shard] = []
        for run in self.runs:
            for table in TABLES:
                folder = run.path / TABLES[table][0]
                names = listings[run.id, table]
                listing = catalogue(names) if table == "metrics" else None
                if listing is not None:
                    rollups.update({folder / s: folder / r for s, r in listing.rollups.items()})
                    self.stray_rollups += [folder / r for r in listing.stray_rollups]
                for name, rows in _shards_of(table, names, listing):
                    path = folder / name
                    shard = known.get((table, path))
                    if shard is None:  # new: a Path and, without a manifest name, a footer
                        found = (rows, None) if rows is not None else _inspect(table, path)
                        shard = Shard(path, table, *found, run=run.id)
                        new.append(shard)
                        if shard.error is not None:
                            self._report(shard)
                    self.shards[shard.path] = shard
        listed = set(rollups.values())
        self.bad_rollups = {p: e for p, e in self.bad_rollups.items() if p in listed}
        self.rollups = {s: r for s, r in rollups.items() if r not in self.bad_rollups}
        files = self._view_files()
        if self._con is None or not all(
            self._allowed.issuperset(p for _, p in f) for f in files.values()
        ):
            self._connect({p for table_files in files.values() for _, p in table_files})
        self._update_views()
        return new

    def _view_files(self) -> dict[str, list[tuple[str, str]]]:
        """(run id, real path) of the files each view reads: the tables' readable
        shards, and the metrics shards' rollups or, where a shard has none, the shard."""
        files = {table: self._readable(table) for table in TABLES}
        rolled, unrolled = [], []
        for path, shard in self.shards.items():
            if shard.table == "metrics" and shard.error is None:
                rollup = self.rollups.get(path)
                if rollup is None:
                    unrolled.append((shard.run, self._real(path)))
                else:
                    rolled.append((shard.run, self._real(rollup)))
        return {**files, "metrics_rollups": rolled, "metrics_unrolled": unrolled}

    def _update_views(self) -> None:
        """Point each view whose files changed at its files now (planned again for
        each: a view that meets an unreadable file leaves it out of every view)."""
        for view in (*TABLES, *ROLLUP_VIEWS):
            # Listed again for each view, not once: making a view may find a shard
            # unreadable, and the views after it must leave that shard out too.
            files = self._view_files()[view]
            if self._views.get(view) != files:
                self._view(view, files)

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

    def _readable(self, table: str) -> list[tuple[str, str]]:
        """(run id, real path) of the table's readable shards, in listing order."""
        return [
            (s.run, self._real(p))
            for p, s in self.shards.items()
            if s.table == table and s.error is None
        ]

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

    def _view(self, table: str, files: list[tuple[str, str]]) -> None:
        self._views[table] = files
        if table in ROLLUP_VIEWS:
            self._rollup_view(table, files)
            return
        if not files:
            if table == "metrics":  # empty, with the schema: queries still bind
                columns = ", ".join(f"NULL::{kind} AS {name}" for name, kind in METRICS_COLUMNS)
                self._con.execute(f"CREATE OR REPLACE VIEW metrics AS SELECT {columns} WHERE false")
                self._con.execute(
                    f"CREATE OR REPLACE VIEW metrics_written AS SELECT {columns}, "
                    "NULL::VARCHAR AS file, NULL::BIGINT AS row WHERE false"
                )
            else:
                self._con.execute(f"DROP VIEW IF EXISTS {table}")
            return
        if table == "metrics":
            # Write order, for readers that need it (the summary's name order, the
            # trace's nesting): shard names sort by rank and sequence number, and
            # compaction keeps each shard's rows in the order they were written.
            # ``metrics`` is its projection: one file list to parse and bind (a second
            # cost 12 ms on 1,024 files), and the virtual columns cost nothing where a
            # query does not ask for them.
            virtual = "filename AS file, file_row_number AS row"
            written = self._union(files, f"{_COLUMNS}, {virtual}", f"{_DATA_COLUMNS}, {virtual}",
                                  "filename = true, file_row_number = true")  # fmt: skip
            statements = [
                f"CREATE OR REPLACE VIEW metrics_written AS {written}",
                f"CREATE OR REPLACE VIEW metrics AS SELECT {_COLUMNS} FROM metrics_written",
            ]
        else:  # the capture index grew columns over versions
            statements = [
                f"CREATE OR REPLACE VIEW {table} AS "
                + self._union(files, "*", "*", "union_by_name = true")
            ]
        try:
            for statement in statements:
                self._con.execute(statement)
        except self._duckdb.Error as e:  # binding reads the first file: it may be bad
            if not self._drop_culprit(e):
                raise

    def _rollup_view(self, view: str, files: list[tuple[str, str]]) -> None:
        """``metrics_rollups`` (run first, then the rollup's columns and ``file``) or
        ``metrics_unrolled`` (the columns of ``metrics``) over ``files``."""
        if view == "metrics_rollups":
            each = f"{_ROLLUP_DATA}, filename AS file"
            columns = self._union(files, f"run, {each}", each, "filename = true")
            empty = [("run", "VARCHAR"), *(c for c in ROLLUP_COLUMNS if c[0] != "run"),
                     ("file", "VARCHAR")]  # fmt: skip
        else:
            columns = self._union(files, _COLUMNS, _DATA_COLUMNS, "")
            empty = list(METRICS_COLUMNS)
        if not files:  # empty, with the columns: queries still bind
            nulls = ", ".join(f"NULL::{kind} AS {name}" for name, kind in empty)
            columns = f"SELECT {nulls} WHERE false"
        try:
            self._con.execute(f"CREATE OR REPLACE VIEW {view} AS {columns}")
        except self._duckdb.Error as e:  # binding reads the first file: it may be bad
            if not self._drop_culprit(e):
                raise

    def _union(self, files: list[tuple[str, str]], one: str, each: str, options: str) -> str:
        """A SELECT over ``files``: over one run, its columns ``one``; over several, each
        run's id as ``run`` and the columns ``each``, run after run."""
        options = f", {options}" if options else ""
        if not self.several:
            paths = ", ".join(sql_string(f) for _, f in files)
            return f"SELECT {one} FROM read_parquet([{paths}]{options})"
        by_run: dict[str, list[str]] = {}
        for run, path in files:
            by_run.setdefault(run, []).append(sql_string(path))
        # Each run's id is a constant of its own scan: no per-row work to name the run.
        parts = [
            f"SELECT {sql_string(run)} AS run, {each} "
            f"FROM read_parquet([{', '.join(paths)}]{options})"
            for run, paths in by_run.items()
        ]
        return (" UNION ALL BY NAME " if each == "*" else " UNION ALL ").join(parts)

    def extent(self) -> Extent:
        """The steps, ranks and times the readable metrics shards span, from their names
        and Parquet footers alone: no data page is read (70 ms for 64 shards of a
        million steps, where scanning for them took 2.3 s on 2 cores)."""
        self.refresh()
        stats = dict.fromkeys(("step", "time"), (None, None))
        for _ in range(_MAX_RETRIES):
            files = [path for _, path in self._readable("metrics")]
            if not files:
                return Extent(None, None, [], None, None)
            try:
                found = self._con.execute(
                    "SELECT path_in_schema, min(TRY_CAST(stats_min_value AS DOUBLE)), "
                    "max(TRY_CAST(stats_max_value AS DOUBLE)) FROM parquet_metadata($1) "
                    "WHERE path_in_schema IN ('step', 'time') GROUP BY ALL",
                    [files],
                ).fetchall()
            except self._duckdb.Error as e:  # a footer it cannot read: as a query would
                if not self._drop_culprit(e):
                    raise UsageError(f"cannot read the shards' footers: {_first_line(e)}") from None
                continue
            stats.update({column: (low, high) for column, low, high in found})
            break
        names = [
            parse(p.name) for p, s in self.shards.items() if s.table == "metrics" and not s.error
        ]
        if all(n is not None for n in names):
            ranks = sorted({n.rank for n in names})
        else:  # a shard named by hand: its footer does not say, a scan does
            ranks = [r for (r,) in self._con.execute(
                "SELECT DISTINCT rank FROM metrics ORDER BY 1").fetchall()]  # fmt: skip
        first, last = stats["step"]
        return Extent(
            None if first is None else int(first),
            None if last is None else int(last),
            ranks,
            *stats["time"],
        )

    def verify(self) -> list[Shard]:
        """Read every shard's footer (``syncless check``): what the names say is
        checked against the files. Returns the shards found unreadable; rollups whose
        footer is unreadable or not a rollup's go to ``bad_rollups``."""
        bad = []
        for path, shard in list(self.shards.items()):
            if shard.error is not None:
                continue
            rows, error = _inspect(shard.table, path)
            if error is None and shard.table == "metrics" and rows != shard.rows:
                error = f"its name says {shard.rows} rows, the file holds {rows}"
            if error is not None:
                bad.append(self._unreadable(shard, error))
        for rollup in list(self.rollups.values()):
            problem = _rollup_problem(rollup)
            if problem is not None:
                self._bad_rollup(rollup, problem)
        return bad

    def _drop_culprit(self, error: BaseException) -> bool:
        """Mark the shard ``error`` names unreadable (or gone: listed again) and point
        the views past it; False when the error names none of the run's shards."""
        text = str(error)
        for rollup in list(self.rollups.values()):
            if self._real(rollup) in text:
                if not exists(rollup):  # its shard was compacted away since the listing
                    self.refresh()
                else:
                    self._bad_rollup(rollup, _rollup_problem(rollup) or _first_line(error))
                return True
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
            except (OSError, _arrow_error()) as e:
                self._unreadable(shard, _first_line(e))
                found = True
            else:
                self._read_whole.add(path)
        for rollup in list(self.rollups.values()):
            if rollup in self._read_whole:
                continue
            try:
                read_table(rollup)
            except (OSError, _arrow_error()) as e:
                self._bad_rollup(rollup, _first_line(e))
                found = True
            else:
                self._read_whole.add(rollup)
        return found

    def _unreadable(self, shard: Shard, reason: str) -> Shard:
        bad = self.shards[shard.path] = shard._replace(rows=0, error=reason)
        self._report(bad)
        self._update_views()
        return bad

    def _bad_rollup(self, rollup: RunPath, reason: str) -> None:
        """Leave ``rollup`` out from now on: its shard is read record by record."""
        self.bad_rollups[rollup] = reason
        self.rollups = {s: r for s, r in self.rollups.items() if r != rollup}
        if self.warn:
            log.warning("unreadable rollup %s: %s; its shard is read instead", rollup, reason)
        self._update_views()

    def _report(self, shard: Shard) -> None:
        message = f"unreadable shard {shard.path}: {shard.error}"
        if self.strict:
            raise UnreadableShardError(message, shard.path)
        if self.warn:
            log.warning("skipped %s (strict=True or --strict fails instead)", message)


def open(path: str | os.PathLike, *, strict: bool = False) -> RunStore:
    """Open a run directory for queries: ``syncless.run.open("runs/...").sql("...")``."""
    return RunStore(path, strict=strict)


def open_runs(paths: Sequence[str | os.PathLike], *, strict: bool = False) -> RunStore:
    """Open several runs as one store: run directories, and folders that hold runs.

    ``syncless.run.open_runs(["runs"]).sql("SELECT * FROM runs")``: ``metrics.run`` is
    each record's run id, the key of the ``runs`` table.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    return RunStore(list(paths), strict=strict)


def _create_runs_table(con: duckdb.DuckDBPyConnection, runs: list[RunEntry]) -> None:
    """The ``runs`` table, one row per run (syncless.run.runset); a table, not a view:
    it holds what the runs' run.json files said when the store opened."""
    table = runs_table(runs)
    columns = ", ".join(
        '"' + c.replace('"', '""') + f'" {t}'
        for c, t in zip(table.columns, table.types, strict=True)
    )
    con.execute(f"CREATE TABLE runs ({columns})")
    marks = ", ".join("?" for _ in table.columns)
    con.executemany(f"INSERT INTO runs VALUES ({marks})", table.rows)


def _read_info(path: RunPath) -> dict[str, Any]:
    """``run.json``, or a one-line UsageError for a path that is not a run directory."""
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{str(path)!r} is a file, not a run directory")
        return read_run_json(path)
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or _first_line(e)
        raise UsageError(f"cannot read run directory {str(path)!r}: {reason}") from None


def _shards_of(
    table: str, names: list[str], listing: Catalogue | None = None
) -> list[tuple[str, int | None]]:
    """The table's shard files among a folder's ``names``, with their rows where the
    name says them (metrics shards; no file is opened). ``listing``: the names'
    catalogue, where the caller has it."""
    if table != "metrics":
        return [(name, None) for name in sorted(fnmatch.filter(names, TABLES[table][1]))]
    listing = listing or catalogue(names)
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
    except (OSError, _arrow_error()) as e:
        return 0, _first_line(e)
    if table == "metrics":
        from syncless.run.parquet import SCHEMA  # pyarrow: only for shards that need a footer

        types = dict(zip(schema.names, schema.types, strict=True))
        problems = [
            f"{f.name} is missing" if f.name not in types else f"{f.name} is {types[f.name]}"
            for f in SCHEMA
            if types.get(f.name) != f.type
        ]
        if problems:
            return 0, f"not a metrics shard: {'; '.join(problems)}"
    return meta.num_rows, None


def _rollup_problem(path: RunPath) -> str | None:
    """What is wrong with a rollup's footer (unreadable, or not a rollup's columns);
    None when nothing is."""
    try:
        schema = read_metadata(path).schema.to_arrow_schema()
    except (OSError, _arrow_error()) as e:
        return _first_line(e)
    from syncless.run.rollups import SCHEMA  # pyarrow: only when a footer is read

    if not schema.equals(SCHEMA):
        return f"not a rollup: its columns are {', '.join(schema.names)}"
    return None


def _arrow_error() -> type[Exception]:
    import pyarrow as pa  # on first use: a query that opens no footer never imports it

    return pa.ArrowException


def sql_string(text: str) -> str:
    """``text`` as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
