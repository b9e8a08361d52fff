"""Baseline throughput of the demo workload (no syncless tool on).

Runs `syncless demo` as a subprocess for each configuration asked for, reads the run's
shards back with pyarrow and reports the median step time and tokens/s over the steps
after warm-up. Later benchmarks quote these lines as their baseline.

    python -m bench.demo baseline --preset large --steps 40
    python -m bench.demo baseline --preset large --steps 40 --nproc 2 --expert-parallel
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import append_result, metric_values


def median_after_warmup(run_dir: Path, name: str, warmup: int) -> tuple[float, int]:
    values = metric_values(run_dir, name, warmup)
    return statistics.median(values), len(values)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args, extra = parser.parse_known_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "syncless.cli", "demo", "--preset", args.preset,
               "--steps", str(args.steps), "--log-every", "1", "--run-dir", str(run_dir),
               "--quiet", *extra]  # fmt: skip
        if args.nproc > 1:
            cmd += ["--nproc", str(args.nproc)]
        subprocess.run(cmd, check=True)
        step_ms, n = median_after_warmup(run_dir, "demo/step/step_ms", args.warmup)
        tps, _ = median_after_warmup(run_dir, "demo/step/tokens_per_s", args.warmup)

    what = f"demo {args.preset} nproc={args.nproc} {' '.join(extra)}".strip()
    line = f"{what}: median step {step_ms:.1f} ms, {tps:,.0f} tokens/s (steps {args.warmup}..{args.steps - 1}, n={n})"
    print(line)
    if not args.no_record:
        append_result("demo_baseline", line)
