"""Run-store scale: shard writes, queries, compaction, summary and report to 1,024 ranks.

Issue #37. For each rank count, a simulated run is written through the real writer:
``Run`` (rank 0) makes the directory and run.json, then every rank gets a
``ParquetSink`` that writes one shard per simulated flush of ``--steps-per-flush``
steps x ``--metrics`` metrics. Ranks are written one after another in this one process
(a simulation: a real job's ranks write in parallel, each on its own host), so write
throughput is that of one writer. Then, with warm file caches:

- queries through ``RunStore(path).query(sql)``, a fresh store per query (what
  ``syncless query`` does), against DuckDB reading the same files directly
  (``read_parquet('RUN_DIR/metrics/*.parquet')``, a fresh connection per query), median
  of ``--repeats``: ``count(*)``, one metric's series over every rank, a GROUP BY over
  names; plus ``syncless query`` once as a process (count(*), process start included);
- compaction (``syncless.run.compact.compact_run``, where this commit has it): seconds
  and shards left, then the same queries again;
- ``syncless summary`` and ``syncless report`` once each as a process, on the run as
  it stands at the end (compacted where compaction exists).

Scale: a day of 10 s flushes is 8,640 flushes (shards) per rank; at the default 10
steps a flush (1 step a second) that is 5.5M records per rank. ``--flushes`` writes a
fraction of that, printed with each run. The default, 100 flushes a rank (1.16% of a
day), makes 102,400 shards and 65.5M records at 1,024 ranks, written in 1.5 min on a
2-core host (one writer, about 1,000 shards/s). A day holds 86x as many shards a rank,
so the before-compaction times are far below a day's. The whole default run takes
about 15-20 min without compaction (at a101289: most of it the queries before
compaction, 15-20 s each at 1,024 ranks). Goals (issue #37), after compaction: one
metric's series <= 1 s on 1,024 ranks, syncless queries <= 1.5x DuckDB direct,
summary and report <= 10 s each. Timings are wall clock on a shared host: a ratio
interleaves its two sides repeat by repeat, so a passing load weighs on both.

    python -m bench.store scale                                    # 64, 256, 1,024 ranks
    python -m bench.store scale --ranks 4,8 --flushes 5 --no-append  # a smoke test
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from bench.harness import append_result, syncless_argv
from syncless.run import ParquetSink, RankInfo, Run, RunStore, StepRecords
from syncless.run.rundir import METRICS_DIR, set_first_step

DAY_FLUSHES = 8_640  # 24 h of 10 s flushes
SERIES_METRIC = "demo/step/loss"
QUERIES = {  # label -> SQL over {metrics}: the table, or read_parquet of the shards
    "count": "SELECT count(*) FROM {metrics}",
    "series": (
        f"SELECT step, rank, value FROM {{metrics}} WHERE name = '{SERIES_METRIC}' "
        "ORDER BY step, rank"
    ),
    "group": "SELECT name, avg(value), max(value) FROM {metrics} GROUP BY name",
}
SERIES_GOAL_S, RATIO_GOAL, VIEW_GOAL_S = 1.0, 1.5, 10.0
GOAL_RANKS = 1_024


def metric_names(count: int) -> list[str]:
    """``count`` names shaped like a monitored run's, so summary and report fill their
    sections: step metrics, profiler sections, data plane, self costs, then per-layer
    monitors for as many layers as it takes."""
    names = [f"demo/step/{m}" for m in ("loss", "lr", "step_ms", "tokens_per_s")]
    names += [f"profile/{s}/time_ms" for s in ("step", "forward", "backward", "optimizer")]
    names += [f"dataplane/step/{op}/{m}" for op in ("get", "put") for m in ("wall_ms", "mb")]
    names += ["monitors/self/flush_ms", "monitors/self/hook_us"]
    per_layer = ("attn_qk_logit_max", "attn_entropy_nats", "act_absmax", "grad_norm")
    layer = 0
    while len(names) < count:
        names += [f"monitors/layer_{layer:02d}/{m}" for m in (*per_layer, "update_ratio")]
        layer += 1
    return names[:count]


@dataclass
class Timings:
    """Query seconds (median of repeats), syncless and DuckDB direct, by query label."""

    syncless: dict[str, float] = field(default_factory=dict)
    duckdb: dict[str, float] = field(default_factory=dict)
    cli_count_s: float = math.nan
    shards: int = 0
    problems: list[str] = field(default_factory=list)

    def ratio(self, label: str) -> float:
        return self.syncless[label] / self.duckdb[label]


@dataclass
class Result:
    ranks: int
    flushes: int
    records: int = 0
    shards: int = 0
    write_s: float = 0.0
    before: Timings = field(default_factory=Timings)
    after: Timings | None = None  # None: no compaction at this commit
    compact_s: float = math.nan
    summary_s: float = math.nan
    report_s: float = math.nan
    report_mb: float = math.nan
    problems: list[str] = field(default_factory=list)


def write_run(run_dir: Path, ranks: int, flushes: int, steps: int, metrics: int) -> Result:
    """Write ``ranks`` ranks of ``flushes`` shards each; return the counts and wall time."""
    run = Run(
        name=run_dir.name,
        run_dir=run_dir,
        flush_interval_s=1e9,
        ranks=RankInfo(rank=0, world_size=ranks, local_rank=0),
    )
    run.close()  # its own sink wrote nothing: rank 0's shards come from the loop below
    set_first_step(run_dir, 0)  # what rank 0's first record would have recorded
    names = metric_names(metrics)
    rng = np.random.default_rng(0)
    result = Result(ranks, flushes)
    t0 = 1.8e9
    start = time.perf_counter()
    for rank in range(ranks):
        sink = ParquetSink(run_dir / METRICS_DIR, rank, flush_interval_s=1e9)
        for flush in range(flushes):
            values = rng.random((steps, len(names))).tolist()
            batch = StepRecords()
            for i, row in enumerate(values):
                step = flush * steps + i
                batch.add(run.name, step, rank, names, row, t0 + step)  # 1 step a second
            sink.write(batch)
            sink.flush()
            result.records += len(batch)
        sink.close()
        result.shards += sink.shards_written
    result.write_s = time.perf_counter() - start
    return result


def shard_count(run_dir: Path) -> int:
    return sum(1 for _ in (run_dir / METRICS_DIR).glob("*.parquet"))


def medians_s(fns: list[Callable[[], Any]], repeats: int) -> list[tuple[float, Any]]:
    """(median seconds, last result) of each of ``fns``, called in turn ``repeats``
    times: interleaved, so a load that comes and goes (a shared 2-core host) weighs on
    syncless and DuckDB alike."""
    times: list[list[float]] = [[] for _ in fns]
    outs: list[Any] = [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            outs[i] = fn()
            times[i].append(time.perf_counter() - start)
    return [(statistics.median(t), out) for t, out in zip(times, outs, strict=True)]


def via_store(run_dir: Path, sql: str) -> list[tuple]:
    with RunStore(run_dir) as store:
        return store.query(sql.format(metrics="metrics"))[1]


def via_duckdb(run_dir: Path, sql: str) -> list[tuple]:
    source = f"read_parquet('{run_dir / METRICS_DIR}/*.parquet')"
    con = duckdb.connect()
    try:
        return con.execute(sql.format(metrics=source)).fetchall()
    finally:
        con.close()


def agree(label: str, ours: list[tuple], theirs: list[tuple]) -> bool:
    if label == "group":  # row order unspecified; averages summed in any order
        a, b = sorted(ours), sorted(theirs)
        return len(a) == len(b) and all(
            x[0] == y[0]
            and all(math.isclose(u, v, rel_tol=1e-9) for u, v in zip(x[1:], y[1:], strict=True))
            for x, y in zip(a, b, strict=True)
        )
    return ours == theirs


def cli_s(problems: list[str], *argv: str) -> tuple[float, str]:
    """Wall seconds of one ``syncless`` process and its stdout; NaN and a problem noted
    when it fails (the other numbers of the run are still worth printing)."""
    start = time.perf_counter()
    done = subprocess.run([*syncless_argv(), *argv], capture_output=True, text=True)
    took = time.perf_counter() - start
    if done.returncode != 0:
        error = (done.stderr.strip().splitlines() or ["no stderr"])[0]
        problems.append(f"syncless {argv[0]} exited {done.returncode}: {error}")
        return math.nan, ""
    return took, done.stdout


def time_queries(run_dir: Path, records: int, repeats: int) -> Timings:
    timings = Timings(shards=shard_count(run_dir))
    for label, sql in QUERIES.items():
        (timings.syncless[label], ours), (timings.duckdb[label], theirs) = medians_s(
            [partial(via_store, run_dir, sql), partial(via_duckdb, run_dir, sql)], repeats
        )
        if not agree(label, ours, theirs):
            timings.problems.append(f"{label}: syncless and DuckDB direct disagree")
        if label == "count" and ours[0][0] != records:
            timings.problems.append(f"count: {ours[0][0]:,} rows, {records:,} written")
    timings.cli_count_s, out = cli_s(
        timings.problems,
        "query",
        str(run_dir),
        QUERIES["count"].format(metrics="metrics"),
        "--format",
        "csv",
    )
    if out and out.split()[-1] != str(records):
        timings.problems.append(f"syncless query count(*) printed {out.split()[-1]}")
    return timings


def compact(run_dir: Path, target_rows: int | None) -> tuple[float, Any] | None:
    """(wall seconds, stats) of compact_run, or None where this commit has none."""
    try:
        from syncless.run.compact import compact_run
    except ModuleNotFoundError as e:
        if e.name != "syncless.run.compact":
            raise  # the module is there but broken: a failure, not an older commit
        return None
    kwargs = {} if target_rows is None else {"target_rows": target_rows}
    start = time.perf_counter()
    stats = compact_run(run_dir, **kwargs)
    return time.perf_counter() - start, stats


def measure(args: argparse.Namespace, root: Path, ranks: int) -> Result:
    run_dir = root / f"ranks{ranks:05d}"
    result = write_run(run_dir, ranks, args.flushes, args.steps_per_flush, args.metrics)
    print(
        f"  written: {result.records:,} records, {result.shards:,} shards "
        f"in {result.write_s:.1f} s",
        flush=True,
    )
    result.before = time_queries(run_dir, result.records, args.repeats)
    print("  queried before compaction", flush=True)
    done = compact(run_dir, args.target_rows)
    if done is not None:
        result.compact_s, stats = done
        result.after = time_queries(run_dir, result.records, args.repeats)
        if stats.shards_after != result.after.shards:
            result.problems.append(
                f"compaction reports {stats.shards_after:,} shards, "
                f"{result.after.shards:,} *.parquet files left"
            )
        print(f"  compacted in {result.compact_s:.1f} s, queried after", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        result.summary_s, _ = cli_s(result.problems, "summary", str(run_dir))
        report = Path(tmp) / "report.html"
        result.report_s, _ = cli_s(result.problems, "report", str(run_dir), "-o", str(report))
        if report.exists():
            result.report_mb = report.stat().st_size / 1e6
    if not args.keep:
        shutil.rmtree(run_dir)
    return result


def seconds(value: float, digits: int = 2) -> str:
    return "failed" if math.isnan(value) else f"{value:.{digits}f} s"


def verdict(value: float, goal: float, unit: str) -> str:
    if math.isnan(value):
        return "not measured (failed)"
    if value <= goal:
        return "met"
    return f"missed by {max(value - goal, 0.01):.2f}{unit}"


def goals(r: Result) -> list[str]:
    """The goals of issue #37, checked on the run as it ends (compacted where possible)."""
    t = r.after or r.before
    series = t.syncless["series"]
    scope = "" if r.ranks == GOAL_RANKS else f", goal set at {GOAL_RANKS:,} ranks"
    out = [
        f"series {series:.2f} s <= {SERIES_GOAL_S:g} s{scope}: "
        f"{verdict(series, SERIES_GOAL_S, ' s')}"
    ]
    for label in QUERIES:
        ratio = t.ratio(label)
        out.append(
            f"{label} {ratio:.2f}x <= {RATIO_GOAL:g}x DuckDB: {verdict(ratio, RATIO_GOAL, 'x')}"
        )
    for label, s in (("summary", r.summary_s), ("report", r.report_s)):
        out.append(f"{label} {seconds(s, 1)} <= {VIEW_GOAL_S:g} s: {verdict(s, VIEW_GOAL_S, ' s')}")
    return out


def goals_state(r: Result) -> str:
    return "after compaction" if r.after is not None else "as written: no compaction"


def scale_text(r: Result, args: argparse.Namespace) -> str:
    return (
        f"{r.ranks:,} ranks x {r.flushes} flushes/rank x {args.steps_per_flush} steps x "
        f"{args.metrics} metrics = {r.records:,} records in {r.shards:,} shards "
        f"({r.flushes / DAY_FLUSHES:.2%} of a day of 10 s flushes, {DAY_FLUSHES:,}/rank)"
    )


def table(r: Result, args: argparse.Namespace) -> str:
    rows = [
        scale_text(r, args),
        f"write (ranks one after another, one process): {r.write_s:.1f} s, "
        f"{r.records / r.write_s:,.0f} records/s, {r.shards / r.write_s:,.0f} shards/s",
    ]
    if r.before.shards != r.shards:
        rows.append(
            f"shards on disk before compaction: {r.before.shards:,} "
            "(the writer merged shards as it went)"
        )
    if r.after is None:
        rows.append("compaction: not available at this commit")
    else:
        rows.append(
            f"compaction: {r.compact_s:.2f} s, {r.before.shards:,} -> {r.after.shards:,} shards"
        )
    header = f"{'query (s, median of ' + str(args.repeats) + ')':<30}"
    header += f"{'syncless':>10}{'duckdb':>10}{'ratio':>8}"
    if r.after is not None:
        header += f"  | after: {'syncless':>10}{'duckdb':>10}{'ratio':>8}"
    rows.append(header)
    for label in QUERIES:
        line = f"{label:<30}"
        for t in (r.before, r.after):
            if t is None:
                continue
            if t is r.after:
                line += "  |        "
            line += f"{t.syncless[label]:>10.3f}{t.duckdb[label]:>10.3f}{t.ratio(label):>7.2f}x"
        rows.append(line)
    line = f"{'syncless query count(*) (CLI)':<30}{r.before.cli_count_s:>10.3f}"
    if r.after is not None:
        line += f"{'':>18}  |        {r.after.cli_count_s:>10.3f}"
    rows.append(line)
    state = "compacted" if r.after is not None else "as written"
    rows.append(
        f"syncless summary (CLI, {state}): {seconds(r.summary_s)}; "
        f"syncless report (CLI): {seconds(r.report_s)} ({r.report_mb:.1f} MB)"
    )
    rows.append(f"goals ({goals_state(r)}): " + "; ".join(goals(r)))
    for problem in problems(r):
        rows.append(f"PROBLEM: {problem}")
    return "\n".join(rows)


def problems(r: Result) -> list[str]:
    out = list(r.problems) + [f"before: {p}" for p in r.before.problems]
    return out + ([f"after: {p}" for p in r.after.problems] if r.after else [])


def queries_text(t: Timings) -> str:
    parts = [
        f"{label} {t.syncless[label]:.3f}/{t.duckdb[label]:.3f} ({t.ratio(label):.2f}x)"
        for label in QUERIES
    ]
    return ", ".join(parts) + f", CLI count(*) {t.cli_count_s:.2f}"


def result_line(r: Result, args: argparse.Namespace) -> str:
    text = (
        f"{scale_text(r, args)}; write (ranks sequential, one process) {r.write_s:.1f} s = "
        f"{r.records / r.write_s:,.0f} records/s, {r.shards / r.write_s:,.0f} shards/s; "
        f"queries s syncless/DuckDB-direct, median of {args.repeats}, fresh store or "
        f"connection each (series = {SERIES_METRIC} over all ranks, group = avg, max by "
        f"name): before compaction [{r.before.shards:,} shards] {queries_text(r.before)}"
    )
    if r.after is None:
        text += "; compaction: not available at this commit"
    else:
        text += (
            f"; compaction {r.compact_s:.2f} s to {r.after.shards:,} shards; after "
            f"{queries_text(r.after)}"
        )
    text += f"; summary {seconds(r.summary_s)}, report {seconds(r.report_s)} (CLI processes)"
    text += f"; goals ({goals_state(r)}): {'; '.join(goals(r))}"
    if problems(r):
        text += f"; PROBLEMS: {'; '.join(problems(r))}"
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,256,1024", help="comma-separated rank counts")
    parser.add_argument(
        "--flushes", type=int, default=100, help=f"shards per rank (a day: {DAY_FLUSHES:,})"
    )
    parser.add_argument("--steps-per-flush", type=int, default=10)
    parser.add_argument("--metrics", type=int, default=64, help="metrics per step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target-rows", type=int, help="compact_run's (default: its own)")
    parser.add_argument("--root", type=Path, help="where runs go (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true", help="leave the runs on disk")
    parser.add_argument("--no-append", action="store_true", help="skip bench/RESULTS.md")
    args = parser.parse_args(argv)
    rank_counts = [int(n) for n in args.ranks.split(",")]
    made_root = args.root is None
    root = Path(tempfile.mkdtemp(prefix="store_scale-")) if made_root else args.root
    root.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for ranks in rank_counts:
            print(f"{ranks:,} ranks under {root}", flush=True)
            r = measure(args, root, ranks)
            print(table(r, args), flush=True)
            results.append(r)
    finally:
        if made_root and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.keep:
        print(f"runs kept under {root}")
    if not args.no_append:
        for r in results:
            print(append_result("store_scale", result_line(r, args)))
