"""``RunAheadLimiter``: let the host run at most ``depth`` pacing points ahead of the device.

A per-layer host drain (``.tolist()`` of routing counts) is also pacing: the host cannot
enqueue layer i+1 before the device has finished layer i, so few tensors are ever
waiting on work that has not run. Remove the drains and the host runs as far ahead as
it can, and everything it has enqueued but the device has not finished stays alive
(buffers handed to other streams such as NCCL's are not reused until that work is
seen to complete). That is how removing the drains can run out of memory.

The limiter keeps the pacing and drops the waiting: at each point it records an event
on the current stream, then waits for the event of the point ``depth`` points back,
and only if that event has not completed yet. ``depth=0`` waits for everything up to
the current point (a drain without a read); a host that is behind the device never
waits. Waits are counted and timed: they are a cost.

Without CUDA events (a CPU device) there is nothing to wait on: the limiter counts its
points as ``unpaced_points`` and does nothing else.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from syncless.guard import allow_sync
from syncless.hot_path import hot_path


class EventLike(Protocol):
    """What the limiter needs of ``torch.cuda.Event`` (a fake one in tests)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def cuda_event() -> EventLike:
    # Timing off: a plain completion marker is cheaper to record and query.
    return torch.cuda.Event(enable_timing=False)


class RunAheadLimiter:
    """Bound the host's lead over the device to ``depth`` pacing points.

    ``device``: with a CUDA device (and no ``event_factory``) the limiter uses CUDA
    events; otherwise it only counts points. ``event_factory`` and ``clock`` replace
    the events and the wait timer (tests).
    """

    def __init__(
        self,
        depth: int,
        *,
        device: torch.device | str | None = None,
        event_factory: Callable[[], EventLike] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if depth < 0:
            raise ValueError(f"run-ahead depth must be >= 0, got {depth}")
        self.depth = depth
        if event_factory is None and device is not None and torch.device(device).type == "cuda":
            event_factory = cuda_event
        self._new_event = event_factory
        self._clock = clock
        # Events of the last points not yet waited on, oldest first (at most depth + 1),
        # and completed ones kept for reuse: recording an event costs less than creating one.
        self._in_flight: deque[EventLike] = deque()
        self._free: list[EventLike] = []
        self.points = 0
        self.unpaced_points = 0
        self.waits = 0
        self.wait_s = 0.0
        self.max_wait_s = 0.0

    @property
    def paced(self) -> bool:
        """False when there are no events to pace on (CPU): ``point()`` only counts."""
        return self._new_event is not None

    @hot_path
    def point(self) -> None:
        """Mark a pacing point; block only if the device is more than ``depth`` points behind."""
        self.points += 1
        if self._new_event is None:
            self.unpaced_points += 1
            return
        event = self._free.pop() if self._free else self._new_event()
        event.record()
        self._in_flight.append(event)
        if len(self._in_flight) > self.depth:
            oldest = self._in_flight.popleft()  # the event of point i - depth
            if not oldest.query():
                self._wait(oldest)
            self._free.append(oldest)

    def _wait(self, event: EventLike) -> None:
        start = self._clock()
        with allow_sync("run-ahead limiter: the host is more than `depth` points ahead"):
            event.synchronize()  # syncless: ok the bounded wait is the pacing itself
        waited = self._clock() - start
        self.waits += 1
        self.wait_s += waited
        self.max_wait_s = max(self.max_wait_s, waited)

    def reset(self) -> None:
        """Forget the in-flight points (e.g. after an explicit synchronization)."""
        self._free.extend(self._in_flight)
        self._in_flight.clear()

    def stats(self) -> dict[str, float]:
        return {
            "points": self.points,
            "unpaced_points": self.unpaced_points,
            "waits": self.waits,
            "wait_s": self.wait_s,
            "max_wait_s": self.max_wait_s,
        }
