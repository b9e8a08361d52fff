"""Section profiler overhead on the demo's train step, per mode, against off, in one run.

The workload is bench/train_step.py (the demo's training step in a tight loop, every
step the same work). Sections: forward / backward / optimizer / log around the loop
phases and one per attention, router and experts module in the forward (forward
hooks), the demo's `--profile` layout on one GPU. "megatron" is a synchronize-per-span
timer in the style of Megatron-LM's timers (torch.cuda.synchronize() at every start
and stop, host clock), the comparison the issue asks for.

Steps run in periods of four: off, off, MODE, off, the mode rotating over events,
sync and megatron from one period to the next. A profiled step's cost is

    (t[ON] + t[ON+1]) - (t[ON-2] + t[ON-1])

relative to the two off steps before it (the step after carries any lagged work).
Printed: median and IQR of those estimates, the ratio of 10th percentiles (host
jitter only adds time), and the profiler's own host time per profiled step (it bills
itself: on the host-bound demo that is its cost, free of step-time noise).

    python bench/profile_overhead.py --preset large --periods 90
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from results import append_result  # bench/ is on sys.path as a script
from torch import nn
from train_step import ON, PERIOD, TrainStep, low_percentile_ratio, paired_estimates

from syncless.demo.config import preset
from syncless.demo.model import Attention, Experts, Router
from syncless.profile import OFF, Profiler

MODES = ["events", "sync", "megatron"]


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


def hook_sections(train: TrainStep) -> list:
    """Sections around every attention, router and experts forward."""
    names = {Attention: "attention", Router: "router", Experts: "experts"}
    handles = []
    for module in train.model.modules():
        name = names.get(type(module))
        if name is None:
            continue

        def begin(_m: nn.Module, _a, name: str = name) -> None:
            train.profiler.begin_section(name)

        def end(_m: nn.Module, _a, _o, name: str = name) -> None:
            train.profiler.end_section(name)

        handles += [module.register_forward_pre_hook(begin), module.register_forward_hook(end)]
    return handles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--periods", type=int, default=30, help="periods in all (modes rotate)")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = preset(args.preset)
    train = TrainStep(cfg, device)
    profilers = {
        "off": OFF,
        "events": Profiler(mode="events", report_every=10**9),
        "sync": Profiler(mode="sync", report_every=10**9),
        "megatron": MegatronTimers(),
    }
    handles = hook_sections(train)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for step in range(3):
        train(step)
    gc.collect()
    gc.freeze()
    last = time.perf_counter()
    for i in range(args.warmup + args.periods * PERIOD):
        period, pos = divmod(i - args.warmup, PERIOD)
        mode = MODES[period % len(MODES)]
        prof = profilers[mode] if i >= args.warmup and pos == ON else OFF
        train.profiler = prof
        prof.begin_step(i)
        train(i)
        prof.end_step()
        now = time.perf_counter()
        if i >= args.warmup:
            times[mode].append(now - last)
        last = now
    for h in handles:
        h.remove()

    all_off = [t for m in MODES for j, t in enumerate(times[m]) if j % PERIOD in (0, 1)]
    off_ms = statistics.median(all_off) * 1e3
    print(f"\ndemo {args.preset} train step on {device.type}: off {off_ms:.1f} ms/step, "
          f"{args.periods} periods")  # fmt: skip
    # The profiler bills its own host time (profile/self/host_ms): on a host-bound step
    # that is its cost, read without the step-time noise.
    self_ms = {
        mode: profilers[mode].report(force=True).values["profile/self/host_ms"]
        for mode in ("events", "sync")
    }
    for mode, ms in self_ms.items():
        print(
            f"{mode} profiler's own host time: {ms:.3f} ms/step ({ms / off_ms * 100:.2f}% of off)"
        )
    rows = []
    for mode in MODES:
        est = paired_estimates(times[mode])
        q = statistics.quantiles(est, n=4)
        rows.append((mode, statistics.median(est), q[0], q[2], low_percentile_ratio(times[mode])))
        print(f"{mode:<10}{rows[-1][1]:>+9.2f}%   IQR {q[0]:+.2f}%..{q[2]:+.2f}%   "
              f"p10 ratio {rows[-1][4]:+.2f}%")  # fmt: skip
    if not args.no_record:
        table = "; ".join(
            f"{m} {p:+.2f}% (IQR {lo:+.1f}..{hi:+.1f}, p10 ratio {p10:+.2f}%)"
            for m, p, lo, hi, p10 in rows
        )
        append_result(
            "profile_overhead",
            f"demo {args.preset} train step (tight loop) off {off_ms:.1f} ms/step; profiled "
            f"step vs the 2 off steps before it ({args.periods} periods, modes rotating): {table}; "
            f"profiler's own host time events {self_ms['events']:.3f} ms/step "
            f"({self_ms['events'] / off_ms * 100:.2f}%), sync {self_ms['sync']:.3f} ms/step",
        )


if __name__ == "__main__":
    main()
