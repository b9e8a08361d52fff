"""Wall time of the ``syncless`` commands that should answer at once (issues #21, #48).

Each command runs as an operator meets it, a fresh process per call, against a bare
baseline timed in the same rounds: the commands and their baselines take turns, round
after round, so a passing load weighs on both sides of each ratio. Medians of
``--repeat`` rounds. Goals (issue #48):

- ``syncless --help`` at most 0.15 s (``python -c pass`` is printed beside it: the
  interpreter's own start);
- ``syncless query RUN "SELECT count(*) FROM metrics"`` within 1.5x of a bare DuckDB
  process on the same files (``python -c`` importing duckdb and running the same count
  over ``read_parquet('RUN/metrics/*.parquet')``), on a compacted 64-rank run.

``tests/run/test_cli_startup.py`` checks the imports behind these; this times them.

    python -m bench.store cli_startup
    python -m bench.store cli_startup --repeat 5 --no-append     # a smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from bench.harness import append_result, by_name, interleave, syncless_argv

HELP_GOAL_S, QUERY_RATIO_GOAL = 0.15, 1.5
COUNT = "SELECT count(*) FROM metrics"
BARE = "import duckdb, sys; print(duckdb.sql(sys.argv[1]).fetchall()[0][0])"


def make_run(run_dir: Path, ranks: int) -> None:
    """A compacted run of ``ranks`` ranks: bench/store/scale.py's writer (20 flushes of 10
    steps x 64 metrics a rank), then ``syncless compact``."""
    from bench.store.scale import write_run
    from syncless.run.compact import compact_run

    write_run(run_dir, ranks, flushes=20, steps=10, metrics=64)
    compact_run(run_dir)


def wall_s(name: str, argv: list[str]) -> float:
    """Wall seconds of one fresh process of ``argv``."""
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{name} failed: {done.stderr[-2000:]}")
    return took


def rounds(commands: dict[str, list[str]], repeat: int) -> dict[str, list[float]]:
    """Every command once per round, in turn; wall seconds by command."""
    runs = {name: partial(wall_s, name, argv) for name, argv in commands.items()}
    return by_name(interleave(runs, repeat, rotate=False))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--no-append", action="store_true", help="skip bench/RESULTS.md")
    args = parser.parse_args(argv)
    cli = syncless_argv()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        make_run(run_dir, args.ranks)
        files = str(run_dir / "metrics" / "*.parquet")
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "syncless --help": [*cli, "--help"],
            "bare duckdb": [sys.executable, "-c", BARE, COUNT.replace("metrics", f"read_parquet('{files}')")],
            "syncless query": [*cli, "query", str(run_dir), COUNT, "--format", "csv"],
            "syncless lint": [*cli, "lint", str(Path(__file__).parents[2] / "syncless" / "cli.py")],
        }  # fmt: skip
        load = os.getloadavg()[0]
        times = rounds(commands, args.repeat)
        after = os.getloadavg()[0]
    median = {name: statistics.median(t) for name, t in times.items()}
    ratios = [q / b for q, b in zip(times["syncless query"], times["bare duckdb"], strict=True)]
    ratio = statistics.median(ratios)
    help_s = median["syncless --help"]
    verdicts = [
        f"--help <= {HELP_GOAL_S} s: {'met' if help_s <= HELP_GOAL_S else 'missed'}",
        f"query <= {QUERY_RATIO_GOAL}x bare: {'met' if ratio <= QUERY_RATIO_GOAL else 'missed'}",
    ]
    result = (
        f"wall s per fresh process, median of {args.repeat} interleaved rounds, load average "
        f"{load:.2f} -> {after:.2f}: " + ", ".join(f"{n} {s:.3f}" for n, s in median.items())
        + f"; query / bare duckdb on a compacted {args.ranks}-rank run {ratio:.2f}x "
        f"(per-round ratios {min(ratios):.2f}-{max(ratios):.2f}); " + "; ".join(verdicts)
    )  # fmt: skip
    print(result)
    if not args.no_append:
        print(append_result("cli_startup", result))
