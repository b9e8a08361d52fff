"""Wall time of the ``syncless`` commands that should start at once (issue #21).

``--help``, ``query`` and ``lint`` import no torch (``tests/run/test_cli_startup.py``
checks the imports); this times them as an operator meets them, a fresh process per
call, median of ``--repeat``. The target is ``--help`` <= 0.3 s on a 2-core CI host.
``query`` and ``check`` import DuckDB and pyarrow, which they need.

    python bench/cli_startup.py
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import append_result, syncless_argv  # bench/ is on sys.path as a script

TARGET_HELP_S = 0.3


def wall_s(argv: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-append", action="store_true", help="skip bench/RESULTS.md")
    args = parser.parse_args()
    cli = syncless_argv()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        demo = [*cli, "demo", "--steps", "4", "--run-dir", str(run_dir)]
        subprocess.run(demo, check=True, capture_output=True)
        commands = {
            "--help": [*cli, "--help"],
            "query": [*cli, "query", str(run_dir), "SELECT count(*) FROM metrics"],
            "check": [*cli, "check", str(run_dir)],
            "lint": [*cli, "lint", str(Path(__file__).parents[1] / "syncless" / "cli.py")],
            "python -c pass": [sys.executable, "-c", "pass"],
        }
        times = {name: wall_s(argv, args.repeat) for name, argv in commands.items()}
    help_s = times["--help"]
    verdict = "met" if help_s <= TARGET_HELP_S else f"missed by {help_s - TARGET_HELP_S:.2f} s"
    result = (
        "wall s per fresh process, median of "
        f"{args.repeat}: " + ", ".join(f"{name} {s:.3f}" for name, s in times.items())
        + f" (target --help <= {TARGET_HELP_S} s: {verdict})"
    )  # fmt: skip
    print(result)
    if not args.no_append:
        print(append_result("cli_startup", result))


if __name__ == "__main__":
    main()
