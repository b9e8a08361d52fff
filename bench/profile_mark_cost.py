"""What one span edge of the events profiler costs the host inside the demo's step.

In a loop, recording a timing event costs 1.5-1.8 us (bench/driver_calls.py). Inside
the host-bound demo step, between milliseconds of Python and torch launches, the same
call costs more: its code and data are cold. This probe runs the `profile_overhead`
layout (76 sections on the large preset) with the events timer, and times at each
span edge:

- ``stream``: torch's current-stream lookup (``_cuda_getCurrentRawStream``), at span
  starts only (a span's end is recorded on its start's stream);
- ``record``: the edge's ``cuEventRecord``;
- ``record_again``: a second record right after it (the same call, warm);
- ``noop_driver``: a driver call that does nothing (``cuCtxGetCurrent``);

and in a second pass, at the same edges, a 1-element torch ``add_`` (``launch``: one
kernel launch through torch) and the same again right after (``launch_again``).

    python bench/profile_mark_cost.py --preset large --steps 20
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import time
from typing import Any

import numpy as np
import torch
from profile_overhead import hook_sections  # bench/ is on sys.path as a script
from results import append_result
from train_step import TrainStep, blocking_sync

from syncless.cuda_driver import driver
from syncless.demo.config import preset
from syncless.profile import Profiler
from syncless.profile.timers import EventTimer, HostTimer

clock = time.perf_counter_ns


class SplitEventTimer(EventTimer):
    """The events timer itself, its stream lookup and its record timed where they run
    (the pool, the span logic and the hot path stay the library's)."""

    names = ("stream", "record", "record_again", "noop_driver")

    def __init__(self, parts: dict[str, list[int]]) -> None:
        super().__init__()
        lib = ctypes.PyDLL("libcuda.so.1")
        noop, self._ctx = lib.cuCtxGetCurrent, ctypes.c_void_p()
        ctx_ref = ctypes.byref(self._ctx)
        self._spare = torch.cuda.Event(enable_timing=True)
        self._spare.record()  # creates its CUevent
        spare = self._spare.cuda_event
        stream_of, current_device, record = self._raw_stream, self._get_device, self._record

        def timed_stream(_device: Any) -> int:  # the timer calls stream_of(current_device())
            t0 = clock()
            stream = stream_of(current_device())
            parts["stream"].append(clock() - t0)
            return stream

        def timed_record(event: int, stream: int) -> int:
            t0 = clock()
            result = record(event, stream)
            t1 = clock()
            record(spare, stream)
            t2 = clock()
            noop(ctx_ref)
            t3 = clock()
            for name, ns in zip(self.names[1:], (t1 - t0, t2 - t1, t3 - t2), strict=True):
                parts[name].append(ns)
            return result

        self._raw_stream, self._get_device, self._record = timed_stream, lambda: None, timed_record
        self.parts = parts


class LaunchTimer(HostTimer):
    """Host clock; at each edge, one tiny torch launch and another right after."""

    names = ("launch", "launch_again")

    def __init__(self, parts: dict[str, list[int]]) -> None:
        self.parts = parts
        self.tiny = torch.zeros(1, device="cuda")

    def mark(self) -> int:
        t0 = clock()
        self.tiny.add_(0)
        t1 = clock()
        self.tiny.add_(0)
        t2 = clock()
        self.parts["launch"].append(t1 - t0)
        self.parts["launch_again"].append(t2 - t1)
        return t2

    def mark_end(self, start: int) -> int:
        return self.mark()


def run(train: TrainStep, timer: Any, steps: int, warmup: int) -> None:
    prof = Profiler(mode="events", report_every=10**9, calibrate=False)
    prof._timer = timer
    for i in range(warmup + steps):
        if i == warmup:
            for name in timer.names:  # this pass's parts only
                timer.parts[name].clear()
        train.profiler = prof
        handles = hook_sections(train, prof)
        prof.begin_step(i)
        train(i)
        prof.end_step()
        for h in handles:
            h.remove()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="large")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available() or driver() is None:
        raise SystemExit("profile_mark_cost needs CUDA and libcuda: it times driver calls")
    blocking_sync()
    train = TrainStep(preset(args.preset), torch.device("cuda"))
    for step in range(3):
        train(step)
    gc.collect()
    gc.freeze()
    names = SplitEventTimer.names + LaunchTimer.names
    parts: dict[str, list[int]] = {name: [] for name in names}
    run(train, SplitEventTimer(parts), args.steps, args.warmup)
    run(train, LaunchTimer(parts), args.steps, args.warmup)
    edges = len(parts["record"]) / args.steps
    cells = []
    for name in names:
        us = np.asarray(parts[name]) / 1e3
        p10, p50, p90 = np.percentile(us, [10, 50, 90])
        cells.append(f"{name} {p50:.2f} (p10 {p10:.2f}, p90 {p90:.2f}, mean {us.mean():.2f})")
        print(cells[-1])
    text = (
        f"host us per span edge inside the demo {args.preset} train step ({edges:.0f} edges/step, "
        f"{args.steps} steps), median: " + "; ".join(cells)
    )
    print(text)
    if not args.no_record:
        append_result("profile_mark_cost", text)


if __name__ == "__main__":
    main()
