"""Section profiler overhead on the demo's train step, per mode, against off, in one run.

The workload is bench/demo/train_step.py (the demo's training step in a tight loop, every
step the same work). Sections: forward / backward / optimizer / log around the loop
phases and one per attention, router and experts module in the forward, the demo's
`--profile` layout on one GPU, hooked the way the demo hooks them
(``Profiler.hook_module``). "megatron" is a synchronize-per-span timer in the style of
Megatron-LM's timers (torch.cuda.synchronize() at every start and stop, host clock),
the comparison the issue asks for.

Steps run in periods of four: off, off, MODE, off, the mode rotating over ``--modes``
(events twice per rotation by default: it is the mode with a target). A profiled step's
module hooks are registered before it and removed after it, outside its timing, so the
off steps run the model exactly as without a profiler (no hooks: what ``--profile off``
does). A profiled step's cost is

    (t[ON] + t[ON+1]) - (t[ON-2] + t[ON-1])

relative to the two off steps before it (the step after carries any lagged work).
Printed: median and mean of those estimates with 95% bootstrap intervals, the ratio of
10th percentiles (host jitter only adds time), and the profiler's own host time per
profiled step (it bills itself: on the host-bound demo that is most of its cost, free
of step-time noise; the hooks' dispatch by torch is not in it).

    python -m bench.profile overhead --preset large --periods 200
    python -m bench.profile overhead --preset large --periods 1000 --max-seconds 420 \
        --blocking-sync --dump run0.json    # several runs, then bench/profile/pool.py
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from torch import nn

from bench.demo.train_step import (
    ON,
    PERIOD,
    TrainStep,
    add_blocking_sync_flag,
    blocking_sync,
    low_percentile_ratio,
    overhead_summary,
    paired_estimates,
)
from bench.harness import append_result
from syncless.demo.config import preset
from syncless.demo.model import Attention, Experts, Router
from syncless.profile import OFF, Profiler
from syncless.profile.timers import EventTimer

MODES = ["events", "sync", "megatron", "events-untimed"]


class UntimedEventTimer(EventTimer):
    """A diagnostic: the events timer with timing disabled on its events.

    The host path is the same (same calls, one record per edge); on the device a record
    without timing is cheaper (bench/RESULTS.md, event_device_cost). ``--modes
    events,events-untimed`` tells what the timestamps cost the step on the device.
    Its section times are meaningless (reported as 0).
    """

    timing = False

    def elapsed_ns(self, start: list, end: list) -> float:
        return 0.0


def untimed_profiler() -> Profiler:
    prof = Profiler(mode="events", report_every=10**9)
    if isinstance(prof._timer, EventTimer):
        prof._timer = UntimedEventTimer()
    return prof


class MegatronTimers:
    """Synchronize at every span start and stop, then read the host clock."""

    mode = "megatron"

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._open: dict[str, float] = {}

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def begin_section(self, name: str, category: str = "compute", bytes: int = 0) -> None:
        self._sync()
        self._open[name] = time.perf_counter()

    def end_section(self, name: str) -> None:
        self._sync()
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - self._open.pop(name)

    def section(self, name: str, category: str = "compute", bytes: int = 0):
        timers = self

        class _Span:
            def __enter__(self):
                timers.begin_section(name)

            def __exit__(self, *exc):
                timers.end_section(name)

        return _Span()

    def begin_step(self, step: int) -> None:
        pass

    def end_step(self) -> None:
        pass


SECTIONS = {Attention: "attention", Router: "router", Experts: "experts"}


def hook_sections(train: TrainStep, prof) -> list:
    """Sections around every attention, router and experts forward: the profiler's own
    module hooks, or (for the Megatron-style timers) begin/end in plain hooks."""
    handles = []
    for module in train.model.modules():
        name = SECTIONS.get(type(module))
        if name is None:
            continue
        if isinstance(prof, Profiler) or prof is OFF:
            handles += prof.hook_module(module, name)
            continue

        def begin(_m: nn.Module, _a, name: str = name) -> None:
            prof.begin_section(name)

        def end(_m: nn.Module, _a, _o, name: str = name) -> None:
            prof.end_section(name)

        handles += [module.register_forward_pre_hook(begin), module.register_forward_hook(end)]
    return handles


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--periods", type=int, default=30, help="periods in all (modes rotate)")
    parser.add_argument("--modes", default="events,sync,events,megatron",
                        help="the rotation of profiled modes, one per period")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--max-seconds", type=float, default=float("inf"),
                        help="stop at the first period boundary after this long (a device "
                        "call has a time limit; a run cut by it records nothing)")  # fmt: skip
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--dump", help="also write the per-period estimates here (JSON), "
                        "for bench/profile/pool.py")  # fmt: skip
    add_blocking_sync_flag(parser)
    args = parser.parse_args(argv)
    blocking = args.blocking_sync and blocking_sync()
    sync_mode = "blocking syncs" if blocking else "spinning syncs: waits included"
    rotation = args.modes.split(",")
    if not set(rotation) <= set(MODES):
        parser.error(f"--modes: each of {rotation} must be one of {MODES}")
    modes = list(dict.fromkeys(rotation))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = preset(args.preset)
    train = TrainStep(cfg, device)
    profilers = {
        "off": OFF,
        "events": Profiler(mode="events", report_every=10**9),
        "sync": Profiler(mode="sync", report_every=10**9),
        "megatron": MegatronTimers(),
        "events-untimed": untimed_profiler(),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpus: dict[str, list[float]] = {m: [] for m in modes}  # training thread CPU time
    for step in range(3):
        train(step)
    gc.collect()
    gc.freeze()
    deadline = time.perf_counter() + args.max_seconds
    for i in range(args.warmup + args.periods * PERIOD):
        period, pos = divmod(i - args.warmup, PERIOD)
        if pos == 0 and period > 0 and time.perf_counter() > deadline:
            break
        # The warm-up profiles too (the pools and the section table fill there).
        mode = rotation[period % len(rotation)]
        prof = profilers[mode] if pos == ON else OFF
        train.profiler = prof
        handles = hook_sections(train, prof)  # outside the step's time
        start, start_cpu = time.perf_counter(), time.thread_time()
        prof.begin_step(i)
        train(i)
        prof.end_step()
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        for h in handles:
            h.remove()
        if i >= args.warmup:
            times[mode].append(elapsed)
            cpus[mode].append(cpu)

    all_off = [t for m in modes for j, t in enumerate(times[m]) if j % PERIOD in (0, 1)]
    off_ms = statistics.median(all_off) * 1e3
    print(f"\ndemo {args.preset} train step on {device.type}: off {off_ms:.1f} ms/step, "
          f"{sum(map(len, times.values())) // PERIOD} periods")  # fmt: skip
    # The profiler bills its own host time (profile/self/host_ms): on a host-bound step
    # that is its cost, read without the step-time noise.
    self_ms = {
        mode: profilers[mode].report(force=True).values["profile/self/host_ms"]
        for mode in ("events", "sync", "events-untimed")
        if mode in modes
    }
    for mode, ms in self_ms.items():
        print(
            f"{mode} profiler's own host time: {ms:.3f} ms/step ({ms / off_ms * 100:.2f}% of off)"
        )
    parts = []
    dump: dict[str, dict] = {}
    for mode in modes:
        est = paired_estimates(times[mode])
        cpu_est = paired_estimates(times[mode], cpus[mode])
        p10 = low_percentile_ratio(times[mode])
        text = f"{mode} " + overhead_summary(est, cpu_est, f", p10 ratio {p10:+.2f}%")
        print(text)
        parts.append(text)
        dump[mode] = {"wall": est, "cpu": cpu_est, "self_ms": self_ms.get(mode)}
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump({"preset": args.preset, "sync": sync_mode, "off_ms": off_ms,
                       "rotation": args.modes, "modes": dump}, f)  # fmt: skip
    own = ", ".join(f"{m} {ms:.3f} ms/step ({ms / off_ms * 100:.2f}%)" for m, ms in self_ms.items())
    if not args.no_record:
        append_result(
            "profile_overhead",
            f"demo {args.preset} train step (tight loop) off {off_ms:.1f} ms/step, off steps "
            f"without hooks; profiled step vs the 2 off steps before it (modes rotating "
            f"{args.modes}, {sync_mode}): {'; '.join(parts)}; profiler's own host time {own}",
        )
