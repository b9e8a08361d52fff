"""``syncless query RUN [RUN ...] "SQL"``: print a query over one run's tables, or several's.

Also the helpers ``syncless check`` shares: warnings on stderr, quiet closed pipes.
This module is on the path of a command that should answer at once: it imports no
pyarrow and no rendering library (tests/run/test_cli_startup.py).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO

from syncless.run.rundir import RUN_JSON
from syncless.run.storage import run_path
from syncless.run.store import RunStore, UnreadableShardError, check_query
from syncless.run.text_table import write_table


def print_query(
    runs: str | Sequence[str],
    sql: str,
    fmt: str = "table",
    out: TextIO | None = None,
    strict: bool = False,
) -> None:
    """Print ``sql`` over ``runs``: one run directory, or several runs and folders
    holding runs (then ``metrics.run`` is each record's run id, as in ``runs``)."""
    check_query(sql)  # before reading the shards: a bad query fails fast
    with open_store(runs, strict=strict) as store:
        columns, rows = store.query(sql)
    print_rows(columns, rows, fmt, out)


def open_store(runs: str | Sequence[str], strict: bool = False) -> RunStore:
    """One run directory as a store of one run; anything else (several paths, a folder
    of runs) as a store of several."""
    paths = [runs] if isinstance(runs, str) else list(runs)
    if len(paths) == 1 and _is_run(paths[0]):
        return RunStore(paths[0], strict=strict)
    return RunStore(paths, strict=strict)


def _is_run(path: str) -> bool:
    try:
        return (run_path(path) / RUN_JSON).is_file() or not run_path(path).is_dir()
    except OSError:
        return True  # RunStore says what is wrong with it


def print_rows(columns: list[str], rows: list[tuple], fmt: str, out: TextIO | None = None) -> None:
    """Rows as a rich table, CSV or a JSON list of row objects."""
    out = out or sys.stdout
    if fmt == "csv":
        writer = csv.writer(out)
        writer.writerow(columns)
        writer.writerows(rows)
    elif fmt == "json":
        json.dump([dict(zip(columns, r, strict=True)) for r in rows], out, default=str, indent=1)
        out.write("\n")
    else:
        write_table(columns, rows, out)


def run(args: argparse.Namespace) -> int:
    """The ``query`` command. Exit status: 0, 1 for an unreadable shard under
    ``--strict``, 2 for a usage error (raised to the caller)."""
    with warnings_on_stderr():
        try:
            to_stdout(lambda out: print_query(args.runs, args.sql, args.format, out, args.strict))
        except UnreadableShardError as e:
            print(f"syncless: error: {e}", file=sys.stderr)
            return 1
    return 0


@contextlib.contextmanager
def warnings_on_stderr() -> Iterator[None]:
    """Print the ``syncless`` logger's warnings as ``syncless: warning: ...`` lines."""
    logger = logging.getLogger("syncless")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("syncless: warning: %(message)s"))
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def to_stdout(write: Callable[[TextIO], None]) -> None:
    """Call ``write(sys.stdout)``. A reader that closed the pipe (``| head -1``) has
    what it wanted: the output stops quietly and the command keeps its exit status."""
    try:
        write(sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would try the flush again at exit and complain: point stdout at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
