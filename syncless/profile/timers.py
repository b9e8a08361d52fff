"""Clocks for spans: the host clock, CUDA events from a reused pool, or synchronize-then-host.

A timer hands out opaque *tokens* on the hot path (``mark``) and turns pairs of them
into nanoseconds later (``elapsed_ns``), on the cold path. Only ``EventTimer`` is
lagged: its tokens are CUDA events whose times are known once the device passed them.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Protocol

import torch

from syncless.cuda_driver import current_raw_stream_fn, driver
from syncless.hot_path import hot_path


class Timer(Protocol):
    """What the profiler needs from a clock."""

    lagged: bool

    def mark(self) -> Any: ...

    def elapsed_ns(self, start: Any, end: Any) -> float: ...

    def wait(self, token: Any) -> None: ...

    def swap(self) -> None: ...


class HostTimer:
    """``time.perf_counter_ns``: exact for host work and for synchronous (gloo) collectives."""

    lagged = False

    @hot_path
    def mark(self) -> int:
        return time.perf_counter_ns()

    def elapsed_ns(self, start: int, end: int) -> float:
        return float(end - start)

    def wait(self, token: int) -> None:
        return None

    def swap(self) -> None:
        return None


class SyncTimer(HostTimer):
    """``sync`` mode: drain the device before every host timestamp.

    Each span then holds its own device work, so the split between sections is right,
    but the step is serialised: read the split, not the total.
    """

    @hot_path
    def mark(self) -> int:
        torch.cuda.synchronize()  # syncless: ok sync mode serialises by design, opt-in only
        return time.perf_counter_ns()


class EventTimer:
    """CUDA events from two reused pools (double buffer), recorded on the current stream.

    Step N records into one pool while step N-1's events, in the other pool, are read
    at the end of step N; after warm-up no event is allocated per span. Nothing on the
    hot path waits for the device. A token is a pool entry: ``(event, CUevent)``.

    Records and elapsed times go through the CUDA driver with the GIL held
    (:mod:`syncless.cuda_driver`): ``Event.record()`` releases the GIL. On the H200's
    host-bound demo step the profiler's own host time for 76 sections went from 5.96
    to 3.88 ms per step with the driver calls (bench/RESULTS.md, 4e46bc2, a9d2e96). A
    mark binds everything it calls once (raw handles, the driver function, torch's C
    getters for the current device and stream): each Python-level lookup is host time
    on every span. Where the driver is unavailable or refuses a call, torch's methods
    are used.
    """

    lagged = True

    def __init__(self) -> None:
        self._pools: tuple[list[tuple[torch.cuda.Event, int]], ...] = ([], [])
        self._parity = 0
        self._cursor = 0
        drv = driver()
        self._driver = drv
        self._record = drv.record_fn() if drv is not None else None
        self._stream = current_raw_stream_fn()
        self._out = ctypes.c_float()
        self._out_ref = ctypes.byref(self._out)

    @hot_path
    def mark(self) -> tuple[torch.cuda.Event, int]:
        pool = self._pools[self._parity]
        cursor = self._cursor
        self._cursor = cursor + 1
        if cursor >= len(pool):  # warm-up only: the pool keeps its size afterwards
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # torch creates the CUevent at its first record
            token = (event, event.cuda_event)
            pool.append(token)
            return token
        token = pool[cursor]
        record = self._record
        if record is None or record(token[1], self._stream()) != 0:
            token[0].record()
        return token

    def elapsed_ns(
        self, start: tuple[torch.cuda.Event, int], end: tuple[torch.cuda.Event, int]
    ) -> float:
        drv = self._driver
        if drv is not None and drv.elapsed_into(self._out_ref, start[1], end[1]):
            return self._out.value * 1e6
        return start[0].elapsed_time(end[0]) * 1e6

    def wait(self, token: tuple[torch.cuda.Event, int]) -> None:
        # Cold path (end_step of the *next* step, or report): usually long complete.
        token[0].synchronize()

    def swap(self) -> None:
        """Start the next step on the other pool (the caller has read that pool's events)."""
        self._parity ^= 1
        self._cursor = 0

    @property
    def pool_size(self) -> int:
        return len(self._pools[0]) + len(self._pools[1])


def make_timer(mode: str, cuda: bool) -> Timer:
    """The clock for ``mode`` (``events``, ``collectives`` or ``sync``) on this device."""
    if not cuda:
        return HostTimer()
    if mode == "sync":
        return SyncTimer()
    return EventTimer()
