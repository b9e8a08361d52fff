"""Self-calibration: what the profiler's own instruments cost on this machine.

Run once, on the cold path (construction or the first step). The numbers are printed
with every table so a reader can tell a section's time from the instrument's floor.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_REPEATS = 20


@dataclass
class Calibration:
    """Median costs in microseconds; ``None`` where it does not apply here."""

    host_clock_us: float
    event_record_us: float | None = None
    synchronize_us: float | None = None
    rendezvous_us: float | None = None

    def describe(self) -> str:
        parts = [f"host clock {self.host_clock_us:.3f} µs"]
        if self.event_record_us is not None:
            parts.append(f"event record {self.event_record_us:.2f} µs")
        if self.synchronize_us is not None:
            parts.append(f"synchronize {self.synchronize_us:.2f} µs")
        parts.append(
            "rendezvous n/a (single process)"
            if self.rendezvous_us is None
            else f"rendezvous (1-element all_reduce) {self.rendezvous_us:.1f} µs"
        )
        return "calibration: " + ", ".join(parts)


def _median_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1e3


def calibrate(
    cuda: bool, group: dist.ProcessGroup | None, rendezvous: torch.Tensor | None
) -> Calibration:
    """Measure the host clock, event record, synchronize and rendezvous costs.

    ``rendezvous`` is the profiler's 1-element tensor, or ``None`` without a process
    group. With one, this is a collective: every rank of ``group`` must call it.
    """
    clock = []
    for _ in range(_REPEATS):
        t0 = time.perf_counter_ns()
        t1 = time.perf_counter_ns()
        clock.append(t1 - t0)
    cal = Calibration(host_clock_us=_median_us(clock))
    if cuda:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(_REPEATS)]
        torch.cuda.synchronize()
        rec, syn = [], []
        for ev in events:
            t0 = time.perf_counter_ns()
            ev.record()
            t1 = time.perf_counter_ns()
            torch.cuda.synchronize()
            t2 = time.perf_counter_ns()
            rec.append(t1 - t0)
            syn.append(t2 - t1)
        cal.event_record_us = _median_us(rec)
        cal.synchronize_us = _median_us(syn)
    if rendezvous is not None:
        dist.barrier(group=group)  # align the ranks so skew does not pollute the floor
        rdv = []
        for _ in range(_REPEATS // 2):
            t0 = time.perf_counter_ns()
            dist.all_reduce(rendezvous, group=group)
            if cuda and rendezvous.is_cuda:
                torch.cuda.synchronize()
            rdv.append(time.perf_counter_ns() - t0)
        cal.rendezvous_us = _median_us(rdv)
    return cal
