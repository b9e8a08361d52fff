"""Wall time of ``syncless summary`` on a 100k-record run, in a fresh process (issue #22).

The run is written record by record with the run store's ParquetSink: 4 ranks, 250
steps, 100 names a step (loss, lr, step time, 8 layers of monitors with heads and
experts, profiler windows every 10 steps, data-plane ops, self costs). The target is
under 1 s on a 2-core CI host, process start and DuckDB import included.

    python -m bench.store summary_speed
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.harness import append_result, syncless_argv
from syncless.run import ParquetSink, StepRecord
from syncless.run.rundir import METRICS_DIR, write_run_json

TARGET_S = 1.0
RANKS, STEPS = 4, 250


def names() -> list[str]:
    """The 100 names every step has."""
    out = ["demo/step/loss", "demo/step/lr", "demo/step/step_ms", "demo/step/tokens_per_s"]
    for layer in range(8):
        prefix = f"monitors/layer_{layer:02d}"
        out += [f"{prefix}/attn_qk_logit_max/head_{h}" for h in range(4)]
        out += [f"{prefix}/moe_tokens_count/expert_{e}" for e in range(4)]
        out += [f"{prefix}/{m}" for m in ("attn_qk_logit_max", "act_absmax", "grad_norm")]
    out += [f"dataplane/step/{op}/{m}" for op in ("get", "put") for m in ("wall_ms", "mb")]
    return out + [f"monitors/self/m{i}_ms" for i in range(100 - len(out))]


def profile_names() -> list[str]:
    sections = ("data", "forward", "attention", "backward", "a2a", "optimizer")
    out = ["profile/step/time_ms", *(f"profile/{s}/time_ms" for s in sections)]
    return out + [f"profile/a2a/{p}_ms" for p in ("rendezvous", "transfer", "enqueue")]


def write_run(run_dir: Path) -> int:
    run_dir.mkdir(parents=True)
    write_run_json(run_dir, {"name": "bench", "world_size": RANKS})
    rng, count = random.Random(0), 0
    per_step, windows = names(), profile_names()
    for rank in range(RANKS):
        sink = ParquetSink(run_dir / METRICS_DIR, rank, flush_interval_s=3600)
        for step in range(STEPS):
            batch = [StepRecord("bench", step, rank, n, rng.random(), 1e9 + step) for n in per_step]
            if step % 10 == 9:  # the profiler's report window
                batch += [
                    StepRecord("bench", step, rank, n, rng.random(), 1e9 + step) for n in windows
                ]
            sink.write(batch)
            count += len(batch)
            if step % 50 == 49:  # a shard per 50 steps, as a periodic flush would
                sink.flush()
        sink.close()
    return count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-append", action="store_true", help="skip bench/RESULTS.md")
    args = parser.parse_args(argv)
    cli = syncless_argv()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        records = write_run(run_dir)
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            subprocess.run([*cli, "summary", str(run_dir)], check=True, capture_output=True)
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        subprocess.run([*cli, "--help"], check=True, capture_output=True)
        help_s = time.perf_counter() - start
    median = statistics.median(times)
    verdict = "met" if median <= TARGET_S else f"missed by {median - TARGET_S:.2f} s"
    result = (
        f"syncless summary on {records} records ({RANKS} ranks x {STEPS} steps, 20 shards), "
        f"wall s per fresh process, median of {args.repeat}: {median:.3f} "
        f"[{min(times):.3f}..{max(times):.3f}]; --help {help_s:.3f} "
        f"(target < {TARGET_S} s: {verdict})"
    )
    print(result)
    if not args.no_append:
        print(append_result("summary_speed", result))
