"""``syncless query RUN_DIR "SQL"``: print a query over a run's tables.

Also the helpers ``syncless check`` shares: warnings on stderr, quiet closed pipes.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

from rich.console import Console
from rich.table import Table

from syncless.run.store import RunStore, UnreadableShardError, check_query


def print_query(
    run_dir: str, sql: str, fmt: str = "table", out: TextIO | None = None, strict: bool = False
) -> None:
    check_query(sql)  # before reading the shards: a bad query fails fast
    with RunStore(run_dir, strict=strict) as store:
        columns, rows = store.query(sql)
    print_rows(columns, rows, fmt, out)


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
        table = Table(*columns, caption=f"{len(rows)} row(s)")
        for r in rows:
            table.add_row(*("NULL" if v is None else str(v) for v in r))
        Console(file=out, width=max(80, Console().width)).print(table)


def run(args: argparse.Namespace) -> int:
    """The ``query`` command. Exit status: 0, 1 for an unreadable shard under
    ``--strict``, 2 for a usage error (raised to the caller)."""
    with warnings_on_stderr():
        try:
            to_stdout(
                lambda out: print_query(args.run_dir, args.sql, args.format, out, args.strict)
            )
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
