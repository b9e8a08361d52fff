"""``syncless query RUN_DIR "SQL"``: print a query over a run's metrics."""

from __future__ import annotations

import csv
import json
import sys
from typing import TextIO

from rich.console import Console
from rich.table import Table

from syncless.run.store import RunStore


def print_query(run_dir: str, sql: str, fmt: str = "table", out: TextIO | None = None) -> None:
    out = out or sys.stdout
    with RunStore(run_dir) as store:
        columns, rows = store.query(sql)
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
