"""``syncless report``: one run's page (syncless.report.html), or several runs overlaid
(syncless.report.overlay). Its own module: the overlay builds on the one-run page, so
the command that picks between them sits above both."""

from __future__ import annotations

import argparse
import sys
import time

from syncless.run.rundir import RUN_JSON
from syncless.run.storage import run_path


def run(args: argparse.Namespace) -> int:
    """The ``syncless report`` command: one run's report, or several runs overlaid."""
    started = time.perf_counter()
    if len(args.runs) == 1 and (run_path(args.runs[0]) / RUN_JSON).is_file():
        from syncless.report.html import write

        path = write(args.runs[0], args.output)
    else:
        from syncless.report import overlay

        path = overlay.write(args.runs, args.output)
    size = path.stat().st_size / 1e6
    took = time.perf_counter() - started
    print(f"wrote {path} ({size:.1f} MB, {took:.1f} s)", file=sys.stdout)
    return 0
