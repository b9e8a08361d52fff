"""Clocks for spans: the host clock, CUDA events from a reused pool, or synchronize-then-host.

A timer hands out opaque *tokens* on the hot path (``mark``) and turns pairs of them
into nanoseconds later (``elapsed_ns``), on the cold path. Only ``EventTimer`` is
lagged: its tokens are CUDA events whose times are known once the device passed them.
While the stream is being captured into a CUDA graph, every timer hands out a
:class:`~syncless.profile.graph_sections.GraphMark` from its ``graphs`` instead: the
span is then timed by stamps the graph's replays write.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Protocol

import torch

from syncless.cuda_driver import current_raw_stream, driver, raw_stream_getters
from syncless.graphs import capturing
from syncless.hot_path import hot_path
from syncless.profile.graph_sections import GraphMark, GraphSections


class Timer(Protocol):
    """What the profiler needs from a clock."""

    lagged: bool

    def mark(self) -> Any: ...

    def mark_end(self, start: Any) -> Any: ...

    def elapsed_ns(self, start: Any, end: Any) -> float: ...

    def wait(self, token: Any) -> None: ...

    def swap(self) -> None: ...


class HostTimer:
    """``time.perf_counter_ns``: exact for host work and for synchronous (gloo) collectives.

    Under a :class:`~syncless.graphs.StandInGraph` capture (CPU tests) a mark is a
    ``GraphMark``. A span opened before such a capture and closed inside it keeps the
    host clock: only its start asks (a CPU has no device time to get wrong).
    """

    lagged = False

    def __init__(self, graphs: GraphSections | None = None) -> None:
        self.graphs = graphs if graphs is not None else GraphSections(cuda=False)

    # The capture check makes a mark a Python frame: 0.25 us on the CI host where the
    # bare clock took 0.06 (timeit, 10^6 calls). Only CPU runs pay it: CUDA timers
    # skip the check on the default stream.
    @hot_path
    def mark(self) -> Any:
        if capturing(False):
            return self.graphs.mark(0)
        return time.perf_counter_ns()

    @hot_path
    def mark_end(self, start: Any) -> Any:
        if start.__class__ is GraphMark:
            return self.graphs.mark_end(start)
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
    but the step is serialised: read the split, not the total. Inside a captured CUDA
    graph (no synchronize is allowed there) spans are stamped as in the other modes.
    """

    def __init__(self, graphs: GraphSections | None = None) -> None:
        super().__init__(graphs if graphs is not None else GraphSections(cuda=True))

    @hot_path
    def mark(self) -> Any:
        if capturing(True):  # a synchronize would fail the capture: stamps instead
            return self.graphs.mark(current_raw_stream())
        torch.cuda.synchronize()  # syncless: ok sync mode serialises by design, opt-in only
        return time.perf_counter_ns()

    @hot_path
    def mark_end(self, start: Any) -> Any:
        if start.__class__ is GraphMark:
            return self.graphs.mark_end(start)
        if capturing(True):
            return self.graphs.crossed(current_raw_stream())
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
    stream). On a stream being captured into a CUDA graph an event record would be
    captured and never read: a mark there is a ``GraphMark`` (docs/profile.md).
    """

    lagged = True
    timing = True  # events with timing (a diagnostic subclass turns it off)

    def __init__(self, graphs: GraphSections | None = None) -> None:
        self.graphs = graphs if graphs is not None else GraphSections(cuda=True)
        self._pools: tuple[list[list[Any]], ...] = ([], [])
        self._parity = 0
        self._cursor = 0
        drv = driver()
        self._driver = drv
        self._record = drv.record_fn() if drv is not None else None
        self._raw_stream, self._get_device = raw_stream_getters()
        self._out = ctypes.c_float()
        self._out_ref = ctypes.byref(self._out)
        # Whether a stream is being captured: asked only for streams other than the
        # legacy default one (0), which torch's default is and which cannot capture.
        if drv is not None:
            self._stream_capturing = drv.stream_capturing_fn()
        else:
            self._stream_capturing = lambda stream: capturing(True)

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
    def mark(self) -> Any:
        stream = self._raw_stream(self._get_device())
        if stream and capturing(True):
            return self.graphs.mark(stream)
        pool, cursor = self._pools[self._parity], self._cursor
        self._cursor = cursor + 1
        if cursor >= len(pool):
            return self._grow()
        token = pool[cursor]
        token[2] = stream
        record = self._record
        if record is None or record(token[1], stream) != 0:
            token[0].record()
        return token

    @hot_path
    def mark_end(self, start: Any) -> Any:
        """The end of the span ``start`` opened, recorded on ``start``'s stream."""
        if start.__class__ is GraphMark:
            return self.graphs.mark_end(start)
        stream = start[2]
        if stream and self._stream_capturing(stream):
            return self.graphs.crossed(stream)
        pool, cursor = self._pools[self._parity], self._cursor
        self._cursor = cursor + 1
        if cursor >= len(pool):
            return self._grow(stream)
        token = pool[cursor]
        token[2] = stream
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


def make_timer(mode: str, cuda: bool, graphs: GraphSections) -> Timer:
    """The clock for ``mode`` (``events``, ``collectives`` or ``sync``) on this device;
    ``graphs`` times the spans captured into CUDA graphs."""
    if not cuda:
        return HostTimer(graphs)
    if mode == "sync":
        return SyncTimer(graphs)
    return EventTimer(graphs)
