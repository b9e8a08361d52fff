"""``syncless captures RUN_DIR``: what a run captured, from its capture index.

The ``captures`` table of ``syncless query`` is the index the capture sink writes (one
row per tensor, ``docs/capture.md``); this command is its two common questions
without SQL: per tag, how many tensors over which steps and ranks, of what dtype and
shape, and how many bytes (the default); or every tensor (``--all``). Read through the
run store's sandbox, so it never imports torch and an unreadable index shard is skipped
with a warning.
"""

from __future__ import annotations

import argparse
import sys

from syncless.run.query_cli import print_rows, to_stdout, warnings_on_stderr
from syncless.run.store import RunStore, UnreadableShardError

PER_TAG = """
SELECT tag, count(*) AS tensors, min(step) AS first_step, max(step) AS last_step,
       count(DISTINCT step) AS steps, count(DISTINCT rank) AS ranks,
       string_agg(DISTINCT dtype, ' ' ORDER BY dtype) AS dtypes,
       string_agg(DISTINCT array_to_string(shape, 'x'), ' ') AS shapes,
       sum(nbytes) AS bytes
FROM captures GROUP BY tag ORDER BY tag
"""
EVERY = """
SELECT tag, step, rank, dtype, array_to_string(shape, 'x') AS shape, nbytes AS bytes
FROM captures ORDER BY step NULLS FIRST, rank, seq
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (runs/<time>-<name>)")
    parser.add_argument(
        "--all", action="store_true", help="one row per captured tensor instead of per tag"
    )
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table")
    parser.add_argument(
        "--strict", action="store_true", help="fail (exit 1) on an unreadable index shard"
    )


def run(args: argparse.Namespace) -> int:
    """Exit status: 0; 1 when the run has no captures, or on an unreadable index shard
    under ``--strict``; 2 for a usage error (raised to the caller)."""
    with warnings_on_stderr():
        try:
            with RunStore(args.run_dir, strict=args.strict) as store:
                if "captures" not in store.tables:
                    print(
                        f"syncless: {args.run_dir} has no captures (`syncless demo --capture "
                        "LAYERS` captures, or syncless.capture in a training loop)",
                        file=sys.stderr,
                    )
                    return 1
                columns, rows = store.query(EVERY if args.all else PER_TAG)
        except UnreadableShardError as e:
            print(f"syncless: error: {e}", file=sys.stderr)
            return 1
    to_stdout(lambda out: print_rows(columns, rows, args.format, out))
    return 0
