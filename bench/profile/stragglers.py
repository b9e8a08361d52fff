"""Straggler scoring at 1,024 ranks x 50 sections, and ``syncless stragglers`` on such a run.

Issue #47. Goals: scoring a report costs at most 5 ms on a CPU; a 1,024-rank run's
verdicts read back in at most 1 s with ``syncless stragglers RUN`` (a fresh process,
its start included).

- scoring: ``StragglerDetector.update`` on a 1,024 x 50 :class:`Fleet` (the numpy
  part: window, fleet medians, verdicts), median of ``--repeats`` reports; beside it
  ``fleet()``, which turns 1,024 gathered RankSummary objects of 50 sections into that
  matrix (Python over the summaries), and ``StepTimes.take``, the per-step cost.
- read back: a synthetic run written through the run store's own ParquetSink, as the
  profiler writes it (``--reports`` reports of 10 steps; per rank and report, 50
  sections x 5 records: time_ms, calls_count, depth_count, order_count and
  straggler_score), a shard per report, then compacted as a finished run is, and each
  rank's placement file (host, local rank, GPU), as its Run writes it. Three
  ranks are stragglers (ground truth checked in the command's JSON). Then
  ``syncless stragglers RUN`` as a process, median of ``--repeats``.

    python -m bench.profile stragglers
    python -m bench.profile stragglers --ranks 64 --reports 5 --no-append   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import append_result, syncless_argv
from syncless.profile.stragglers import (
    Fleet,
    StepTimes,
    StragglerDetector,
    fleet,
)
from syncless.profile.summary import RankSummary, SectionTotals, StepMedians
from syncless.run import ParquetSink, RankInfo, Run
from syncless.run.compact import compact_run
from syncless.run.placement import Placement, write_placement
from syncless.run.records import StepRecords
from syncless.run.rundir import METRICS_DIR

SCORE_GOAL_MS, READ_GOAL_S = 5.0, 1.0
STEPS = 10  # per report
# Ground truth of the synthetic run: (rank, section, first report, last report, score).
SLOW = [(17, "section_07", 5, None, 0.4), (900, "section_31", 10, 14, 0.6),
        (333, "gpu_clock", 3, 3, 0.7)]  # fmt: skip


def sections(count: int) -> list[str]:
    return [f"section_{i:02d}" for i in range(count)]


def random_fleet(rng: np.random.Generator, ranks: int, names: list[str]) -> Fleet:
    ms = rng.uniform(1.0, 1.1, (ranks, len(names))) * STEPS
    ms[7, 3] *= 3.0  # one straggler
    return Fleet(np.arange(ranks), names, np.full(len(names), -1), ms, np.full(ranks, STEPS),
                 ms.sum(axis=1))  # fmt: skip


def time_scoring(ranks: int, count: int, repeats: int) -> dict[str, float]:
    """Median ms: ``update`` on a ranks x sections report, ``fleet()`` from summaries, and
    ``StepTimes.take`` per step (us)."""
    rng = np.random.default_rng(0)
    names = sections(count)
    detector = StragglerDetector()
    reports = [random_fleet(rng, ranks, names) for _ in range(8)]
    for i, report in enumerate(reports):  # a full window first
        detector.update(report, i * STEPS, i * STEPS + STEPS - 1)
    update, update_cpu = [], []
    for i in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        detector.update(reports[i % len(reports)], i * STEPS, i * STEPS + STEPS - 1)
        update.append(time.perf_counter() - start)
        update_cpu.append(time.thread_time() - start_cpu)
    summaries = []
    for rank in range(ranks):
        secs = {n: SectionTotals(n, "compute", "section", None, 1e6 * STEPS, STEPS) for n in names}
        medians = StepMedians.of(tuple(names), np.full(len(names), 1e6))
        summaries.append(RankSummary(rank, STEPS, 5e7 * STEPS, 0.0, 0, secs, step_medians=medians,
                                     host=f"node-{rank // 8:04d}", device=f"cuda:{rank % 8}"))  # fmt: skip
    # As the gather delivers them: each rank's object unpickled on its own.
    summaries = [pickle.loads(pickle.dumps(s)) for s in summaries]
    build, build_cpu = [], []
    for _ in range(max(5, repeats // 10)):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fleet(summaries)
        build.append(time.perf_counter() - start)
        build_cpu.append(time.thread_time() - start_cpu)
    times, totals = StepTimes(), [0.0] * (count + 1)
    take = []
    for _ in range(repeats):
        totals = [t + 1.0 for t in totals]
        start = time.perf_counter()
        times.take(totals, 0)
        take.append(time.perf_counter() - start)
    return {
        "update_ms": statistics.median(update) * 1e3,
        "update_cpu_ms": statistics.median(update_cpu) * 1e3,
        "fleet_ms": statistics.median(build) * 1e3,
        "fleet_cpu_ms": statistics.median(build_cpu) * 1e3,
        "take_us": statistics.median(take) * 1e6,
    }


def write_run(run_dir: Path, ranks: int, reports: int, count: int) -> int:
    """The records a profiled run of ``ranks`` ranks stores (see the module docstring);
    returns how many."""
    run = Run(name=run_dir.name, run_dir=run_dir, flush_interval_s=1e9,
              ranks=RankInfo(rank=0, world_size=ranks, local_rank=0))  # fmt: skip
    run.close()
    names = sections(count)
    per_section = ["time_ms", "calls_count", "depth_count", "order_count", "straggler_score"]
    record_names = [f"profile/{s}/{p}" for s in names for p in per_section]
    record_names += [
        "profile/step/time_ms",
        "profile/self/host_ms",
        "profile/gpu_clock/straggler_score",
    ]
    rng = np.random.default_rng(1)
    written = 0
    for rank in range(ranks):
        sink = ParquetSink(run_dir / METRICS_DIR, rank, flush_interval_s=1e9)
        for report in range(reports):
            step = report * STEPS + STEPS - 1
            values = rng.uniform(0.9, 1.1, len(record_names))
            extra_names, extra_values = [], []
            for slow_rank, section, first, last, score in SLOW:
                if rank == slow_rank and report >= first and (last is None or report <= last):
                    values[record_names.index(f"profile/{section}/straggler_score")] = score
                    verdict = f"profile/{section}/straggler_verdict"
                    extra_names += [f"{verdict}_first_step", f"{verdict}_last_step",
                                    f"{verdict}_score"]  # fmt: skip
                    extra_values += [first * STEPS, step, score]
            batch = StepRecords()
            batch.add(run.name, step, rank, record_names + extra_names,
                      values.tolist() + extra_values, 1.8e9 + step)  # fmt: skip
            sink.write(batch)
            sink.flush()
            written += len(batch)
        sink.close()
        # Where the rank ran, as its Run records it: the command reads the named ranks'.
        place = Placement(rank, f"node-{rank // 8:04d}", rank % 8, 1000 + rank, f"cuda:{rank % 8}")
        write_placement(run_dir, place)
    return written


def read_back(run_dir: Path, repeats: int) -> tuple[float, list[dict]]:
    """Median wall seconds of ``syncless stragglers RUN --format json``, and its verdicts."""
    argv = [*syncless_argv(), "stragglers", str(run_dir), "--format", "json"]
    took, out = [], ""
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True)
        took.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"syncless stragglers failed: {done.stderr[-2000:]}")
        out = done.stdout
    return statistics.median(took), json.loads(out)


def check(verdicts: list[dict], ranks: int, reports: int) -> list[str]:
    """Where the command's verdicts differ from the ground truth (SLOW: those of its
    stragglers that the run's ranks and reports hold)."""
    want = {
        (r, s): (first * STEPS, min(reports - 1, reports if last is None else last) * STEPS + 9)
        for r, s, first, last, _ in SLOW
        if r < ranks and first < reports
    }
    got = {(v["rank"], v["section"]): (v["first_step"], v["last_step"]) for v in verdicts}
    hosts = {v["rank"]: v.get("host") for v in verdicts}
    placed = {r: f"node-{r // 8:04d}" for r in hosts}
    return ([] if got == want else [f"verdicts {got} != {want}"]) + (
        [] if hosts == placed else [f"hosts {hosts} != {placed}"]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--sections", type=int, default=50)
    parser.add_argument("--reports", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=200, help="scored reports")
    parser.add_argument("--reads", type=int, default=5, help="syncless stragglers runs")
    parser.add_argument("--no-run", action="store_true", help="time the scoring only")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    timing = time_scoring(args.ranks, args.sections, args.repeats)
    print(f"scoring {args.ranks} x {args.sections}: update {timing['update_ms']:.2f} ms wall, "
          f"{timing['update_cpu_ms']:.2f} ms CPU; fleet() {timing['fleet_ms']:.2f} ms wall, "
          f"{timing['fleet_cpu_ms']:.2f} ms CPU; StepTimes.take {timing['take_us']:.1f} us")  # fmt: skip
    read_text = "not run (--no-run)"
    if not args.no_run:
        read_text = read_part(args)
    met = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    # The goal is the report's whole scoring: Profiler.report() runs both per report.
    cost = timing["update_cpu_ms"] + timing["fleet_cpu_ms"]
    result = (
        f"{args.ranks} ranks x {args.sections} sections, load average {load:.1f} on "
        f"{os.cpu_count()} cores: scoring {cost:.2f} ms CPU per report (goal <= "
        f"{SCORE_GOAL_MS:g} ms: {met(cost <= SCORE_GOAL_MS)}): StragglerDetector.update "
        f"{timing['update_cpu_ms']:.2f} ms CPU ({timing['update_ms']:.2f} ms wall; median of "
        f"{args.repeats}) and fleet() from the gathered summaries "
        f"{timing['fleet_cpu_ms']:.1f} ms CPU ({timing['fleet_ms']:.1f} ms wall); "
        f"StepTimes.take {timing['take_us']:.1f} us per step; {read_text}"
    )
    if not args.no_append:
        print(append_result("stragglers", result))


def read_part(args: argparse.Namespace) -> str:
    """Write, compact and read back the synthetic run; the result's words."""
    with tempfile.TemporaryDirectory(prefix="syncless-stragglers-") as root:
        run_dir = Path(root) / "run"
        start = time.perf_counter()
        records = write_run(run_dir, args.ranks, args.reports, args.sections)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        compact_run(run_dir)
        compact_s = time.perf_counter() - start
        read_s, verdicts = read_back(run_dir, args.reads)
    problems = check(verdicts, args.ranks, args.reports)
    print(f"run: {records:,} records, written in {write_s:.1f} s, compacted in {compact_s:.1f} s;"
          f" syncless stragglers {read_s:.2f} s; {len(verdicts)} verdicts"
          + (f"; PROBLEMS: {problems}" if problems else " (as written)"))  # fmt: skip
    met = "met" if read_s <= READ_GOAL_S else "MISSED"
    return (
        f"syncless stragglers RUN --format json (fresh process, median of {args.reads}) "
        f"{read_s:.2f} s (goal <= {READ_GOAL_S:g} s: {met}) on a compacted synthetic run of "
        f"{records:,} records ({args.reports} reports of {STEPS} steps, 5 records per "
        f"section and report), {len(verdicts)} verdicts"
        + (f"; PROBLEMS: {problems}" if problems else " as written")
    )
