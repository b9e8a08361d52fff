"""The HTML report of a long run: 1,000,000 steps on 64 ranks (issue #48).

Goal: ``syncless report RUN`` in at most 5 s, a page of at most 10 MB. The run is
synthetic, written with pyarrow straight into the files ``syncless compact`` leaves (one
shard per rank, row groups of 131,072 records, names that are the manifest, and each
shard's rollup, written by compaction's own ``write_rollup``): a real writer would take
hours to log it. (A data set kept from before rollups has none: ``syncless compact`` on
it writes them, or delete it.) Each rank logs ``--metrics`` step metrics every
step (the demo's loss, lr, step_ms, tokens_per_s, ...), with a loss spike on one rank
at one step; rank 0 also logs ``--layers`` layers x 5 monitors every ``--monitor-every``
steps, as a budgeted monitor stack would. Values are random walks, so buckets differ.

The report runs as a fresh process (what a user runs, imports included), ``--repeat``
times on warm file caches; the median is the result. The run directory is kept
(``--dir``): a second call reuses it.

    python -m bench.store report_scale                          # 64 ranks x 1,000,000 steps
    python -m bench.store report_scale --ranks 4 --steps 20000 --no-append   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.harness import append_result, syncless_argv
from syncless.run.parquet import SCHEMA
from syncless.run.rollups import write_rollup
from syncless.run.rundir import FORMAT, METRICS_DIR
from syncless.run.shards import shard_name

GOAL_S, GOAL_MB = 5.0, 10.0
STEP_METRICS = ("loss", "lr", "step_ms", "tokens_per_s", "grad_norm", "balance_loss")
MONITORS = ("attn_qk_logit_max", "attn_entropy_nats", "act_absmax", "grad_norm", "update_ratio")
ROW_GROUP = 131_072  # what syncless compact writes (syncless.run.compact)
SPIKE = (7, 612_345)  # (rank, step) of a loss spike the bands must keep


def write_run(run_dir: Path, ranks: int, steps: int, metrics: int, layers: int, every: int) -> int:
    """Write the run; return its records."""
    (run_dir / METRICS_DIR).mkdir(parents=True)
    info = {"format": FORMAT, "name": run_dir.name, "start_time": 1.8e9, "world_size": ranks,
            "config": {"steps": steps, "ranks": ranks, "synthetic": True}}  # fmt: skip
    (run_dir / "run.json").write_text(json.dumps(info))
    names = [f"demo/step/{m}" for m in STEP_METRICS[:metrics]]
    layer_names = [f"monitors/layer_{i:02d}/{m}" for i in range(layers) for m in MONITORS]
    rng = np.random.default_rng(0)
    records = 0
    for rank in range(ranks):
        step = np.repeat(np.arange(steps, dtype=np.int64), len(names))
        name = np.tile(np.arange(len(names), dtype=np.int32), steps)
        value = np.cumsum(rng.normal(0, 0.01, len(step))) + 5.0
        if rank == SPIKE[0] and SPIKE[1] < steps:
            value[SPIKE[1] * len(names)] = 1e3  # the loss, at that step
        all_names = names
        if rank == 0 and layers:
            monitored = np.arange(0, steps, every, dtype=np.int64)
            step = np.concatenate([step, np.repeat(monitored, len(layer_names))])
            name = np.concatenate([name, np.tile(np.arange(len(layer_names), dtype=np.int32)
                                                 + len(names), len(monitored))])  # fmt: skip
            value = np.concatenate([value, rng.random(len(monitored) * len(layer_names))])
            order = np.argsort(step, kind="stable")  # written in step order
            step, name, value = step[order], name[order], value[order]
            all_names = names + layer_names
        table = pa.table(
            {
                "run": pa.DictionaryArray.from_arrays(
                    pa.array(np.zeros(len(step), dtype=np.int32)), [run_dir.name]
                ).cast(pa.string()),
                "step": step,
                "rank": np.full(len(step), rank, dtype=np.int32),
                "name": pa.DictionaryArray.from_arrays(pa.array(name), all_names).cast(pa.string()),
                "value": value,
                "time": 1.8e9 + step.astype(np.float64),
            },
            schema=SCHEMA,
        )
        shard = shard_name(rank, 1, 1, (0, steps - 1), len(step))
        write_rollup(run_dir / METRICS_DIR, shard, table)  # as compaction does, before its shard
        pq.write_table(table, run_dir / METRICS_DIR / shard, row_group_size=ROW_GROUP)
        records += len(step)
    return records


def report_s(run_dir: Path, page: Path, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([*syncless_argv(), "report", str(run_dir), "-o", str(page)], check=True,
                       capture_output=True)  # fmt: skip
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--metrics", type=int, default=4, help="step metrics per rank")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--monitor-every", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/syncless-report-scale"))
    parser.add_argument("--no-append", action="store_true", help="skip bench/RESULTS.md")
    args = parser.parse_args(argv)
    shape = f"r{args.ranks}-s{args.steps}-m{args.metrics}-l{args.layers}-e{args.monitor_every}"
    run_dir = args.dir / shape
    if not run_dir.exists():
        start = time.perf_counter()
        records = write_run(run_dir, args.ranks, args.steps, args.metrics, args.layers,
                            args.monitor_every)  # fmt: skip
        print(f"wrote {records:,} records in {time.perf_counter() - start:.0f} s: {run_dir}")
    shards = sorted((run_dir / METRICS_DIR).glob("*.parquet"))
    records = sum(pq.read_metadata(p).num_rows for p in shards)
    rollups = len(list((run_dir / METRICS_DIR).glob("*.rollup")))
    page = run_dir.parent / f"{shape}.html"
    times = report_s(run_dir, page, args.repeat)
    took, mb = statistics.median(times), page.stat().st_size / 1e6
    met = "met" if took <= GOAL_S and mb <= GOAL_MB else "missed"
    result = (
        f"{args.ranks} ranks x {args.steps:,} steps, {args.metrics} step metrics a rank every "
        f"step + {args.layers} layers x {len(MONITORS)} monitors every {args.monitor_every} "
        f"steps on rank 0 ({records / 1e6:.1f}M records, {len(shards)} shards, {rollups} "
        f"rollups): syncless report {took:.2f} s (median of {args.repeat}, fresh process; "
        f"{', '.join(f'{t:.2f}' for t in times)}), page {mb:.2f} MB "
        f"(goal <= {GOAL_S:.0f} s, <= {GOAL_MB:.0f} MB: {met})"
    )  # fmt: skip
    print(result)
    if not args.no_append:
        print(append_result("report_scale", result))
