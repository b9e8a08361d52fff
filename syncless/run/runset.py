"""Several runs read as one: which directories are runs, their ids, the ``runs`` table.

A path passed to ``syncless query`` (or :func:`syncless.run.open_runs`) is a run
directory (it holds ``run.json``) or a root that holds runs: its subfolders and
theirs are searched for run directories, which are not searched further. Each run
gets an id, its directory name, or its path below the runs' common parent when two
share a name: ``metrics.run`` and ``runs.run`` hold it, so the two tables join.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from syncless.errors import UsageError
from syncless.run.rundir import RUN_JSON, read_run_json
from syncless.run.storage import RunPath, run_path

__all__ = ["RunEntry", "RunsTable", "find_runs", "flatten", "runs_table"]

log = logging.getLogger(__name__)

#: How deep below a root folder runs are looked for: its subfolders and theirs
#: (``runs/<run>``, ``runs/<project>/<run>``). Deeper trees: pass each root.
ROOT_DEPTH = 2

# The runs table's own columns, before the config's; a config key of the same name is
# kept as ``config.<key>`` unless it equals the column in every run that has it.
FIXED = (
    ("run", "VARCHAR"),
    ("name", "VARCHAR"),
    ("path", "VARCHAR"),
    ("start", "TIMESTAMP"),
    ("world_size", "BIGINT"),
    ("git_commit", "VARCHAR"),
)


class RunEntry(NamedTuple):
    """One run of a store: its id (``metrics.run``), directory and ``run.json``."""

    id: str
    path: RunPath
    info: dict[str, Any]


class RunsTable(NamedTuple):
    """The ``runs`` table: column names, their DuckDB types, one row per run."""

    columns: list[str]
    types: list[str]
    rows: list[tuple]


def find_runs(paths: Sequence[str | os.PathLike]) -> list[RunEntry]:
    """The runs at or below ``paths``, in the order given (a root's runs by name).

    Raises UsageError for a path that is neither a run nor a folder holding runs. A
    run found below a root whose ``run.json`` cannot be read is skipped with a
    warning; one named directly is an error.
    """
    if not paths:
        raise UsageError("no run given: pass run directories or a folder that holds runs")
    found: dict[str, tuple[RunPath, dict[str, Any]]] = {}  # resolved path -> run
    for given in paths:
        path = run_path(given)
        if _is_run(path):
            found.setdefault(_key(path), (path, read_run_json(path)))
            continue
        below = list(_runs_below(path, ROOT_DEPTH))
        if not below:
            raise UsageError(_not_a_run(path))
        for run in below:
            try:
                found.setdefault(_key(run), (run, read_run_json(run)))
            except UsageError as e:
                log.warning("skipped %s: %s", run, e)
    if not found:
        raise UsageError(f"no readable run under {', '.join(map(str, paths))}")
    runs = list(found.values())
    return [
        RunEntry(i, p, info) for i, (p, info) in zip(_ids([p for p, _ in runs]), runs, strict=True)
    ]


def runs_table(runs: Sequence[RunEntry]) -> RunsTable:
    """One row per run: the FIXED columns, then every config key of any run (nested
    keys joined by ``.``), typed by the values the runs hold."""
    fixed = [_fixed(r) for r in runs]
    configs = [flatten(r.info.get("config") or {}) for r in runs]
    keys = list(dict.fromkeys(k for c in configs for k in c))
    names = [n for n, _ in FIXED]
    columns, types, values = list(names), [t for _, t in FIXED], []
    for key in keys:
        column = [c.get(key) for c in configs]
        if key in names:
            at = names.index(key)
            if all(v is None or v == f[at] for v, f in zip(column, fixed, strict=True)):
                continue  # where the config has the key, it says what the column says
            key = f"config.{key}"
        kind = _kind(column)
        columns.append(key)
        types.append(kind)
        values.append([_cast(v, kind) for v in column])
    rows = [tuple(f) + tuple(v[i] for v in values) for i, f in enumerate(fixed)]
    return RunsTable(columns, types, rows)


def _is_run(path: RunPath) -> bool:
    try:
        return (path / RUN_JSON).is_file()
    except OSError:
        return False


def _runs_below(folder: RunPath, depth: int) -> Iterable[RunPath]:
    try:
        children = sorted((p for p in folder.iterdir() if p.is_dir()), key=lambda p: p.name)
    except OSError:  # not a folder, or not readable: the caller says what it is not
        return
    for child in children:
        if _is_run(child):
            yield child
        elif depth > 1:
            yield from _runs_below(child, depth - 1)


def _not_a_run(path: RunPath) -> str:
    if not path.exists():
        return f"run directory {str(path)!r} does not exist"
    if not path.is_dir():
        return f"{str(path)!r} is a file, not a run directory"
    return (
        f"{str(path)!r} is not a syncless run: it has no {RUN_JSON}, and neither do its "
        f"folders ({ROOT_DEPTH} levels down). Pass run directories (made by `syncless demo` "
        "or `syncless.run.Run`) or a folder that holds them (by default ./runs)"
    )


def _key(path: RunPath) -> str:
    try:
        return str(path.resolve())
    except (OSError, NotImplementedError):  # an object store: its URL is its name
        return str(path)


def _ids(paths: list[RunPath]) -> list[str]:
    """Directory names; where two runs share one, their paths below the common parent."""
    names = [p.name for p in paths]
    if len(set(names)) == len(names):
        return names
    parts = [_key(p).replace("\\", "/").split("/") for p in paths]
    common = 0  # folders every path starts with (each keeps at least its own name)
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return ["/".join(p[common:]) for p in parts]


def _fixed(run: RunEntry) -> tuple:
    info, env = run.info, run.info.get("env") or {}
    start = info.get("start_time")
    when = datetime.datetime.fromtimestamp(start) if isinstance(start, int | float) else None
    world = info.get("world_size")
    return (
        run.id,
        str(info.get("name", run.path.name)),
        str(run.path),
        when,
        world if isinstance(world, int) else None,
        env.get("git_commit"),
    )


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level, their keys joined by ``.``: ``{"opt": {"lr": 1}}`` is
    ``{"opt.lr": 1}``."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _kind(values: list[Any]) -> str:
    """The DuckDB type that holds every value: numbers stay numbers, so that
    ``WHERE lr > 1e-3`` works; anything mixed is text."""
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return "BOOLEAN"
    if present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return "BIGINT"
    if present and all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        return "DOUBLE"
    return "VARCHAR"


def _cast(value: Any, kind: str) -> Any:
    if value is None or kind != "VARCHAR":
        return value
    return value if isinstance(value, str) else json.dumps(value, default=str)
