"""Python's garbage collections during a benchmark, per generation and per mode.

A collection runs on whichever thread allocates when a threshold trips, the training
thread included; a full one walks every tracked object (bench/RESULTS.md, gc_pause). The
capture benchmarks count them per mode: the engine's own objects change how often
they come (docs/capture.md, "Garbage collection").
"""

from __future__ import annotations

import collections
import contextlib
import gc
import time
from collections.abc import Iterator


class GcClock:
    """Counts collections and their milliseconds, per generation, into ``key``'s bucket
    (None: not counted) while :meth:`installed`."""

    def __init__(self) -> None:
        self.key: str | None = None
        self._start = 0.0
        self.count: dict[str, collections.Counter[int]] = collections.defaultdict(
            collections.Counter
        )
        self.ms: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.key is not None:
            generation = info["generation"]
            self.count[self.key][generation] += 1
            self.ms[self.key][generation] += (time.perf_counter() - self._start) * 1e3

    @contextlib.contextmanager
    def installed(self) -> Iterator[GcClock]:
        gc.callbacks.append(self)
        try:
            yield self
        finally:
            gc.callbacks.remove(self)

    def generations(self, key: str) -> str:
        """``gen 0 N (X ms), gen 1 ..., gen 2 ...``"""
        count, ms = self.count[key], self.ms[key]
        return ", ".join(f"gen {g} {count[g]} ({ms[g]:.0f} ms)" for g in (0, 1, 2))

    def per_step(self, key: str, steps: int) -> str:
        """Collections and milliseconds a step, with the full ones apart."""
        count, ms = self.count[key], self.ms[key]
        return (
            f"{sum(count.values()) / steps:.1f} collections a step ({count[2]} of "
            f"generation 2 in {steps} steps, {ms[2]:.0f} ms), "
            f"{sum(ms.values()) / steps:.2f} ms a step"
        )
