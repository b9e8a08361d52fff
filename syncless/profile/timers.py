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

from syncless.cuda_driver import driver, raw_stream_getters
from syncless.hot_path import hot_path


class Timer(Protocol):
    """What the profiler needs from a clock."""

    lagged: bool

    def mark(self) -> Any: ...

    def mark_end(self, start: Any) -> Any: ...

    def elapsed_ns(self, start: Any, end: Any) -> float: ...

    def wait(self, token: Any) -> None: ...

    def swap(self) -> None: ...


class HostTimer:
    """``time.perf_counter_ns``: exact for host work and for synchronous (gloo) collectives."""

    lagged = False

    # The clock itself, not a method around it: inside a step a Python frame per span
    # edge is host time (bench/hook_dispatch.py --cold).
    mark = staticmethod(time.perf_counter_ns)

    @hot_path
    def mark_end(self, start: int) -> int:
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

    @hot_path
    def mark_end(self, start: int) -> int:
        return self.mark()


class EventTimer:
    """CUDA events from two reused pools (double buffer), recorded on the current stream.

    Step N records into one pool while step N-1's events, in the other pool, are read
    at the end of step N; after warm-up no event is allocated per span. Nothing on the
    hot path waits for the device. A token is a pool entry: ``[event, CUevent,
    CUstream it was recorded on]``.

    Records and elapsed times go through the CUDA driver with the GIL held
    (:mod:`syncless.cuda_driver`): ``Event.record()`` releases the GIL. On the H200's
    host-bound demo step the profiler's own host time for 76 sections went from 5.96
    to 3.88 ms per step with the driver calls (bench/RESULTS.md, 4e46bc2, a9d2e96).
    Inside that step a record costs several times what it costs in a loop: the
    driver's code is cold after the milliseconds of Python between two sections
    (``profile_mark_cost``). So a mark does as little else as it can: everything it
    calls is bound once, and a span's end (``mark_end``) is recorded on the stream
    its start was, without asking torch for the current stream again. Where the
    driver is unavailable or refuses a call, torch's methods are used (on the current
    stream).
    """

    lagged = True
    timing = True  # events with timing (a diagnostic subclass turns it off)

    def __init__(self) -> None:
        self._pools: tuple[list[list[Any]], ...] = ([], [])
        self._parity = 0
        self._cursor = 0
        drv = driver()
        self._driver = drv
        self._record = drv.record_fn() if drv is not None else None
        self._raw_stream, self._get_device = raw_stream_getters()
        self._out = ctypes.c_float()
        self._out_ref = ctypes.byref(self._out)

    def _grow(self, stream: int | None = None) -> list[Any]:
        """Warm-up only: the pool keeps its size afterwards. Records on ``stream``
        (default: the current one)."""
        event = torch.cuda.Event(enable_timing=self.timing)
        event.record()  # torch creates the CUevent at its first record
        current = self._raw_stream(self._get_device())
        other = stream is not None and stream != current
        if other and (self._record is None or self._record(event.cuda_event, stream) != 0):
            event.record(torch.cuda.ExternalStream(stream))
        token = [event, event.cuda_event, current if stream is None else stream]
        self._pools[self._parity].append(token)
        return token

    @hot_path
    def mark(self) -> list[Any]:
        pool, cursor = self._pools[self._parity], self._cursor
        self._cursor = cursor + 1
        if cursor >= len(pool):
            return self._grow()
        token = pool[cursor]
        stream = self._raw_stream(self._get_device())
        token[2] = stream
        record = self._record
        if record is None or record(token[1], stream) != 0:
            token[0].record()
        return token

    @hot_path
    def mark_end(self, start: list[Any]) -> list[Any]:
        """The end of the span ``start`` opened, recorded on ``start``'s stream."""
        pool, cursor = self._pools[self._parity], self._cursor
        self._cursor = cursor + 1
        if cursor >= len(pool):
            return self._grow(start[2])
        token = pool[cursor]
        stream = token[2] = start[2]
        record = self._record
        if record is None or record(token[1], stream) != 0:
            token[0].record()
        return token

    def elapsed_ns(self, start: list[Any], end: list[Any]) -> float:
        drv = self._driver
        if drv is not None and drv.elapsed_into(self._out_ref, start[1], end[1]):
            return self._out.value * 1e6
        return start[0].elapsed_time(end[0]) * 1e6

    def wait(self, token: list[Any]) -> None:
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
