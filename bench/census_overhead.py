"""What `syncless.guard.census()` costs on the demo step (it is a diagnostic, not always-on).

Runs the demo in-process, alternating runs without and with a census over every step
after warm-up (A B A B ...), and compares the median step time of the same steps.

    python bench/census_overhead.py --preset tiny --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from results import append_result, metric_values  # bench/ is on sys.path as a script

from syncless.demo.config import preset
from syncless.demo.sync_census import SyncCensusTool
from syncless.demo.train import run_demo


def step_times(run_dir: Path, first: int) -> list[float]:
    return metric_values(run_dir, "demo/step/step_ms", first)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    cfg = preset(args.preset, steps=args.steps, log_every=1)
    base, cens = [], []
    syncs_per_step = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            run = run_demo(cfg, run_dir=Path(tmp) / f"base{rep}", quiet=True)
            base += step_times(run.run_dir, args.warmup)
            tool = SyncCensusTool(steps=args.steps - args.warmup, first=args.warmup)
            run = run_demo(cfg, run_dir=Path(tmp) / f"census{rep}", quiet=True, tools=[tool])
            cens += step_times(run.run_dir, args.warmup)
            syncs_per_step = tool.syncs_per_step
    b, c = statistics.median(base), statistics.median(cens)
    line = (
        f"census() over every step, demo {args.preset} ({cfg.steps} steps, {args.reps} reps, "
        f"median of steps {args.warmup}+): baseline {b:.1f} ms/step, census {c:.1f} ms/step, "
        f"x{c / b:.2f} ({syncs_per_step:.0f} syncs/step counted)"
    )
    print(line)
    if not args.no_record:
        append_result("census_overhead", line)


if __name__ == "__main__":
    main()
