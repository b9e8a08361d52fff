"""Step-time overhead of the built-in monitors on the demo's train step, in one run.

The workload is bench/demo/train_step.py: the demo's training step in a tight loop, every
step the same work (why: see there). Monitor records still go to a Run with its
Parquet sink: emitting them is part of the cost. Garbage collection stays on (monitors
allocate; collections are theirs to pay), with the setup's objects frozen out of it.

For each phase (``stack``: every monitor at its default cadence, norms on in 1 of 10
monitored steps; ``all``: every monitor every time; each monitor alone; the naive
implementation) the monitors stay attached for a segment of steps and are switched on
by the host cadence in a period-4 pattern: off, off, ON, off. A monitored step's hooks and its flush land
in its own step time (the flush runs after the optimizer step and before the loss
read-back, as in the demo: lagged, it overlaps the device's tail of the step), and any
lagged device work in the next step's, so the cost of one monitored step is

    (t[ON] + t[ON+1]) - (t[ON-2] + t[ON-1])

relative to the two off steps before it; pairs 2 steps apart cancel slow drift. The
interquartile range of the per-period estimates is printed: an overhead inside it is
not resolved by the run.

The monitors run without the overhead budget (``budget=None``): this benchmark sets
their cadence itself, in the pattern above. Attached-but-inactive hooks still run (they return at once): that cost is in every
step of a segment and so is not in the estimate; it is a few Python calls per layer.

Next to each overhead it prints the monitor's floor: the bytes it must read per
monitored step at the H200's measured copy bandwidth, as a share of the off step
(meaningful on the H200 only). It also checks zero syncs attributed to
syncless.monitors (a census over one period of the "all" phase) and exactly one D2H
copy per flush.

    python -m bench.monitors overhead --preset large --periods 30
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from bench.demo.train_step import (
    ON,
    PERIOD,
    TrainStep,
    add_blocking_sync_flag,
    blocking_sync,
    bootstrap_ci,
    low_percentile_ratio,
    paired_estimates,
)
from bench.harness import append_result
from bench.monitors.naive import NaiveMonitors
from syncless import kernels
from syncless.demo.config import preset
from syncless.guard import census
from syncless.monitors import MONITORS, attach, build
from syncless.monitors.adapters import find_layers
from syncless.monitors.layer_batch import launch_mode
from syncless.run import Run


def run_phase(
    phase: str, train: TrainStep, run: Run, periods: int, warmup: int, stats: dict
) -> list[float]:
    """Per-step wall times of one phase (segment), monitors on at ON of each period."""
    handle = naive = None
    if phase == "naive":
        naive = NaiveMonitors(find_layers(train.model))
    elif phase == "stack":  # every monitor at its default cadence (norms every 10)
        handle = attach(
            train.model, build(list(MONITORS), optimizer=train.optimizer), run=run, budget=None
        )
    else:
        names = list(MONITORS) if phase == "all" else [phase]
        handle = attach(
            train.model, build(names, optimizer=train.optimizer, every=1), run=run, budget=None
        )
    times = []
    flush_s = 0.0

    def timed_flush(step: int) -> None:
        nonlocal flush_s
        assert handle is not None
        start = time.perf_counter()
        handle.step(step)
        flush_s += time.perf_counter() - start

    step0 = stats.setdefault("step", 0)
    cpus: list[float] = []  # the training thread's CPU time per step
    last, last_cpu = time.perf_counter(), time.thread_time()
    for i in range(warmup + periods * PERIOD):
        # The warm-up follows the same pattern, so the first monitored steps (Triton
        # compiles, the first flushes) are not measured or billed.
        on = (i - warmup) % PERIOD == ON
        if i == warmup and handle is not None:
            handle.hook_host_ns_total = dict.fromkeys(handle.hook_host_ns_total, 0)
            handle.readout_host_ns_total = 0
            flush_s = 0.0
        if handle is not None:
            # A monitored step counts as one training step for the cadences: a monitor
            # with every=10 is on in every 10th of them. In the warm-up every monitor
            # is on at each ON step, whatever its cadence: norms' first active step
            # compiles its kernels (1.3 s), which at 77b78c1 landed in the stack
            # phase's first measured period on a machine with a cold Triton cache.
            monitored = (i - warmup) // PERIOD
            for m in handle.monitors:
                m.active = on and (i < warmup or monitored % m.every == 0)
        if naive is not None:
            naive.active = on
        counting = phase == "all" and i == warmup + PERIOD  # one census period
        guard = census() if counting else None
        if guard is not None:
            guard.__enter__()
        flush = partial(timed_flush, step0 + i) if on and handle is not None else None
        train(step0 + i, before_read=flush)  # flush only after a monitored step
        if on and naive is not None:
            naive.norms(train.model)
        if guard is not None:
            guard.step(step0 + i)
            guard.__exit__(None, None, None)
            for (site, _op), n in guard.by_site().items():
                where = site.display()  # path:line, or dotted.module:line outside the cwd
                if "syncless/monitors/" in where or "syncless.monitors." in where:
                    stats["monitor_syncs"] = stats.get("monitor_syncs", 0) + n
        now, now_cpu = time.perf_counter(), time.thread_time()
        if i >= warmup:
            times.append(now - last)
            cpus.append(now_cpu - last_cpu)
        last, last_cpu = now, now_cpu
    stats.setdefault("cpu", {})[phase] = cpus
    stats["step"] = step0 + warmup + periods * PERIOD
    if handle is not None:
        m = handle.metrics
        handle.close()
        stats["copies_ok"] = stats.get("copies_ok", True) and m.d2h_copies == m.flushes
        # Host time the stack bills itself, per monitored step: its hooks (on and off
        # steps of the segment) and its flush. On a host-bound step that is its cost.
        hooks_ms = sum(handle.hook_host_ns_total.values()) / 1e6 / periods
        stats.setdefault("self_host_ms", {})[phase] = (hooks_ms, flush_s * 1e3 / periods)
        # Off the training thread (attach's readout thread on CUDA): decode, derives and
        # records, which take the GIL only where training lets it go.
        stats.setdefault("readout_ms", {})[phase] = handle.readout_host_ns_total / 1e6 / periods
    if naive is not None:
        naive.close()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--periods", type=int, default=20, help="monitored steps per phase")
    parser.add_argument(
        "--warmup",
        type=int,
        default=8,
        help="unmeasured steps per phase; 2 periods, so the first readout (decoded at the "
        "second monitored step, with its one-time costs) stays out of the measurement",
    )
    parser.add_argument("--kernels", default="auto", choices=kernels.BACKENDS)
    parser.add_argument(
        "--phases",
        default=",".join(["stack", "all", *MONITORS, "naive"]),
        help="comma-separated; stack: every monitor at its default cadence",
    )
    parser.add_argument("--dump", help="write every phase's per-step times (s) to this JSON")
    add_blocking_sync_flag(parser)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    kernels.set_backend(args.kernels)
    blocking = args.blocking_sync and blocking_sync()
    phases = args.phases.split(",")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = args.kernels
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and kernels.triton_importable() else "torch"
    backend += f" kernels, {launch_mode(None)} launches"

    cfg = preset(args.preset)
    train = TrainStep(cfg, device)
    for step in range(3):  # compile, allocate, warm the caching allocator
        train(step)
    gc.collect()
    gc.freeze()  # the setup's objects leave the collector's generations
    stats: dict = {}
    rows, off_steps, dumped, means, cis, cpu_cis = [], [], {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(name="monitors-overhead", run_dir=Path(tmp) / "run")
        for phase in phases:
            times = run_phase(phase, train, run, args.periods, args.warmup, stats)
            dumped[phase] = times
            est = paired_estimates(times)
            q = statistics.quantiles(est, n=4)
            rows.append((phase, statistics.median(est), q[0], q[2], low_percentile_ratio(times)))
            means[phase] = statistics.fmean(est)
            cis[phase] = (bootstrap_ci(est), bootstrap_ci(est, np.mean))
            cpu_est = paired_estimates(times, stats["cpu"][phase])
            cpu_cis[phase] = (statistics.median(cpu_est), bootstrap_ci(cpu_est))
            off_steps += [t for i, t in enumerate(times) if i % PERIOD in (0, 1)]
        run.close()
    if args.dump:
        Path(args.dump).write_text(json.dumps(dumped))
    off_ms = statistics.median(off_steps) * 1e3
    n_params = sum(p.numel() for p in train.model.parameters())
    floors = floor_bytes(cfg, n_params)

    # The "stack" phase runs norms in 1 of 10 monitored steps, which a median of
    # per-step estimates cannot see: its mean and its self-billed host time can.
    stack_mean = means.get("stack")
    print(f"\ndemo {args.preset} train step on {device.type}, {backend}: off "
          f"{off_ms:.1f} ms/step, {args.periods} monitored steps per phase")  # fmt: skip

    every = {m.name: m.every for m in build(list(MONITORS), optimizer=_DummyOpt())}

    def floor_pct(phase: str) -> float:
        if phase == "stack":
            return (
                sum(b / every[m] for m, b in floors.items()) / HBM_BYTES_PER_S * 1e3 / off_ms * 100
            )
        nbytes = sum(floors.values()) if phase == "all" else floors.get(phase, 0.0)
        return nbytes / HBM_BYTES_PER_S * 1e3 / off_ms * 100

    self_ms = stats.get("self_host_ms", {})

    readout_ms = stats.get("readout_ms", {})

    def self_text(phase: str) -> str:
        if phase not in self_ms:
            return ""
        hooks, flush = self_ms[phase]
        text = f"{hooks:.2f}+{flush:.2f} ms ({(hooks + flush) / off_ms * 100:.2f}%)"
        if readout_ms.get(phase):
            text += f", readout thread {readout_ms[phase]:.2f} ms"
        return text

    print(f"{'phase':<14}{'overhead':>10}{'IQR':>20}{'p10 ratio':>11}{'HBM floor':>12}"
          "   self host: hooks+flush /monitored step")  # fmt: skip
    for phase, pct, lo, hi, p10 in rows:
        floor = f"{floor_pct(phase):.3f}%" if phase != "naive" else ""
        print(f"{phase:<14}{pct:>+9.2f}%{lo:>+11.2f}%..{hi:+.2f}%{p10:>+10.2f}%{floor:>12}"
              f"   {self_text(phase)}")  # fmt: skip
    for phase, ((lo, hi), (mlo, mhi)) in cis.items():
        print(f"{phase}: 95% bootstrap CI of the median {lo:+.2f}..{hi:+.2f}%, of the mean "
              f"{means[phase]:+.2f}% {mlo:+.2f}..{mhi:+.2f}%")  # fmt: skip
    sync_mode = "blocking syncs" if blocking else "spinning syncs: waits included"
    for phase, (med, (lo, hi)) in cpu_cis.items():
        print(f"{phase}: training thread's CPU time {med:+.2f}% of the step (95% CI "
              f"{lo:+.2f}..{hi:+.2f}, {sync_mode})")  # fmt: skip
    if stack_mean is not None:
        print(f"stack at default cadences: mean of per-step estimates {stack_mean:+.2f}%")
    syncs = stats.get("monitor_syncs", 0)
    print(f"syncs in syncless.monitors during the census period: {syncs}")
    print(f"one D2H copy per flush: {stats.get('copies_ok')}")

    if not args.no_record:
        table = "; ".join(
            f"{p} {pct:+.2f}% (95% CI {cis[p][0][0]:+.2f}..{cis[p][0][1]:+.2f}, mean "
            f"{means[p]:+.2f}% CI {cis[p][1][0]:+.2f}..{cis[p][1][1]:+.2f}, "
            f"IQR {lo:+.2f}..{hi:+.2f}, p10 ratio {p10:+.2f}%, floor "
            f"{floor_pct(p):.3f}%{', self host ' + self_text(p) if p in self_ms else ''})"
            for p, pct, lo, hi, p10 in rows
        )
        append_result(
            "monitors_overhead",
            f"demo {args.preset} train step (tight loop), {backend}, off {off_ms:.1f} "
            f"ms/step; per monitored step vs the 2 off steps before it ({args.periods} "
            f"periods/phase): {table}"
            + ("" if stack_mean is None else f"; stack mean estimate {stack_mean:+.2f}%")
            + "; training thread's CPU time "
            + ", ".join(
                f"{p} {med:+.2f}% (95% CI {lo:+.2f}..{hi:+.2f})"
                for p, (med, (lo, hi)) in cpu_cis.items()
            )
            + f" ({sync_mode})"
            + f"; monitor syncs {syncs}; 1 D2H/flush {stats.get('copies_ok')}",
        )


# Device-to-device copy bandwidth (reads + writes) measured on an H200 with torch 2.11
# (shared/NOTES.md, 2026-11-30): the rate a monitor's unavoidable bytes move at best.
HBM_BYTES_PER_S = 4.3e12


def floor_bytes(cfg, n_params: int) -> dict[str, float]:
    """Bytes each monitor must read per monitored step, at the least.

    activations / nonfinite: each layer's output once (fp32 residual stream). attention:
    q and k once (bf16 on CUDA). moe: the router logits (fp32). norms: every parameter
    and gradient (fp32) for the norms, plus the snapshot copy (read + write) and the
    update pass (two reads) for the update ratio.
    """
    tokens = cfg.batch_size * cfg.seq_len
    act = cfg.n_layers * tokens * cfg.d_model * 4
    return {
        "activations": act,
        "nonfinite": act,
        "attention": cfg.n_layers * tokens * 2 * cfg.d_model * 2,
        "moe": cfg.n_layers * tokens * cfg.n_experts * 4,
        "norms": n_params * 4 * (2 + 2 + 2),
    }


class _DummyOpt(torch.optim.SGD):
    def __init__(self) -> None:
        super().__init__([torch.zeros(1, requires_grad=True)], lr=0.0)
