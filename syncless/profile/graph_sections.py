"""Sections inside captured CUDA graphs: device timestamps in fixed words, read lagged.

A captured region's Python runs once, at capture; a replay runs only its device work.
So a span whose edges are taken while its stream is captured is timed by the graph
itself: each edge enqueues a stamp kernel (:mod:`syncless.kernels.timestamps`) that
every replay runs again. The span owns three int64 words of one preallocated buffer
(start stamp, total ns, replays). After each step the profiler copies the used words
into a pinned ring with one non-blocking copy and reads them once the copy has landed.
Where the count of replays did not grow, the graph was not replayed: no span. The
docs are in docs/profile.md ("Inside CUDA graphs").

:class:`GraphSections` is the recorder's part for this; :class:`GraphMark` is the token
a timer returns under capture. :class:`StandInClock` stands in for the device clock in
CPU tests with :class:`syncless.graphs.StandInGraph`.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from syncless.cuda_driver import current_raw_stream_fn, driver
from syncless.graphs import capturing
from syncless.hot_path import hot_path
from syncless.profile.names import metric

__all__ = ["CAPACITY", "GraphMark", "GraphSections", "StandInClock"]

#: Captured spans the stamp buffer holds, at three int64 words each (24 KiB). A span
#: captured past it is not timed (warned and counted).
CAPACITY = 1024
#: Pinned host buffers the per-step copy goes into, in turn (as MetricSet's flush):
#: a copy is read once landed; with all of them in flight, the oldest is waited for.
HOST_BUFFERS = 4
_WORDS = 3  # per captured span: start stamp, total ns, replays

#: The record that counts captured spans no replay times (cumulative).
UNTIMED_RECORD = metric("self", "untimed_graph_spans_count")


class GraphMark:
    """A span edge taken while its stream was being captured.

    ``base`` is the span's first word in the stamp buffer, or -1 when the span is not
    timed (``reason`` says why). ``stream`` is the ``CUstream`` it was captured on.
    A span's end mark is its start mark when both were stamped.
    """

    __slots__ = ("base", "reason", "stream")

    def __init__(self, base: int, stream: int, reason: str = "") -> None:
        self.base = base
        self.stream = stream
        self.reason = reason


class Clock(Protocol):
    """What enqueues the stamps of a captured span (at capture; replays rerun them)."""

    def start(self, base: int, stream: int) -> None: ...

    def end(self, base: int, stream: int) -> None: ...


class TritonClock:
    """The GPU's global timer, written by the Triton kernels of
    :mod:`syncless.kernels.timestamps` on the span's stream."""

    def __init__(self, stamps: torch.Tensor) -> None:
        from syncless.kernels import timestamps  # imports triton: only here, on CUDA

        self._stamps = stamps
        self._start = timestamps.stamp_start
        self._end = timestamps.stamp_end
        self._current = current_raw_stream_fn()

    @hot_path
    def start(self, base: int, stream: int) -> None:
        self._launch(self._start, base, stream)

    @hot_path
    def end(self, base: int, stream: int) -> None:
        self._launch(self._end, base, stream)

    def _launch(self, kernel: Callable[[torch.Tensor, int], None], base: int, stream: int) -> None:
        if stream == self._current():
            kernel(self._stamps, base)
            return
        # A span ends on the stream it started on, as an event timer's would.
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            kernel(self._stamps, base)


class StandInClock:
    """A device clock for CPU tests under :class:`~syncless.graphs.StandInGraph`.

    ``now`` (an int64 tensor) is the time in ns. Nothing advances it but the test's own
    ops, recorded in the captured region as its "work"::

        clock = prof._graphs.use_stand_in_clock()
        with graph.capture(), prof.section("mlp"):
            clock.now.add_(5_000)  # 5 us of work, at every replay

    The stamps are torch ops the stand-in records and replays. The stand-in also runs
    them once at capture, where a CUDA capture runs nothing: that run is undone through
    numpy, which the stand-in does not see.
    """

    def __init__(self, stamps: torch.Tensor) -> None:
        self.now = torch.zeros((), dtype=torch.int64)
        self._stamps = stamps
        self._words = stamps.numpy()  # made once: no torch call at capture

    @hot_path
    def start(self, base: int, stream: int) -> None:
        words = self._words
        held = words[base]
        self._stamps[base].copy_(self.now)
        words[base] = held

    @hot_path
    def end(self, base: int, stream: int) -> None:
        stamps, words = self._stamps, self._words
        held = words[base + 1 : base + 3].copy()
        stamps[base + 1].add_(self.now - stamps[base])
        stamps[base + 2].add_(1)
        words[base + 1 : base + 3] = held


@dataclass
class _Copy:
    """One step's copy of the used words: where it lands, and when."""

    host: np.ndarray
    event: torch.cuda.Event | None
    size: int

    def landed(self) -> bool:
        return self.event is None or self.event.query()


class GraphSections:
    """Captured spans of one profiler: their words, their template, their lagged reads.

    Args:
        cuda: the profiler times CUDA work (the stamps live on the current device).
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.stamps: torch.Tensor | None = None
        self.clock: Clock | None = None
        # Why captured spans are not timed while there is no clock.
        self.reason = (
            "a step must begin before the capture (the stamps are allocated then)"
            if cuda
            else "no device clock on a CPU"
        )
        self._device = -1
        self._used = 0  # spans given words so far (never reused: a graph may replay)
        # The template: (section id, base, bytes per call) of every stamped span.
        self._template: list[tuple[int, int, int]] = []
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.untimed = 0  # captured spans that no replay times (cumulative)
        self._unwarned: dict[str, str] = {}  # section -> reason, warned at step end
        self._warned: set[str] = set()
        # Host side: the pinned ring, made with the stamps.
        self._host: list[torch.Tensor] = []
        self._host_np: list[np.ndarray] = []
        self._events: list[torch.cuda.Event | None] = []
        self._views: tuple[int, torch.Tensor, list[torch.Tensor]] | None = None
        self._turn = 0
        self._pending: deque[_Copy] = deque()  # oldest first
        self._previous = np.zeros(CAPACITY * _WORDS, dtype=np.int64)
        self._delta = np.zeros(CAPACITY * _WORDS, dtype=np.int64)
        drv = driver() if cuda else None
        # Whether a span's stream is still captured at its end (the driver asks that
        # stream; without it, the current stream is asked).
        self._still_capturing: Callable[[int], bool] = (
            drv.stream_capturing_fn() if drv is not None else self._current_capturing
        )

    @property
    def timed(self) -> int:
        """Captured spans timed at every replay."""
        return len(self._template)

    def capturing(self) -> bool:
        """Whether the current stream is being captured (or a StandInGraph captures)."""
        return capturing(self.cuda)

    def _current_capturing(self, stream: int) -> bool:
        return capturing(self.cuda)

    # -- setup (cold) ------------------------------------------------------------------

    def setup(self) -> None:
        """Allocate the stamp buffer and warm the stamp kernels up (the profiler's first
        step, outside any capture: a kernel compiled or loaded inside one could break
        it). Only on CUDA; captured spans stay untimed where this cannot be done."""
        if not self.cuda or self.clock is not None:
            return
        from syncless.kernels.selection import backend, triton_importable

        if torch.version.hip is not None:
            self.reason = "the stamp kernel reads NVIDIA's %globaltimer"
            return
        if not triton_importable():
            self.reason = "Triton is not installed"
            return
        if backend() == "torch":
            self.reason = "SYNCLESS_KERNELS=torch turns Triton kernels off"
            return
        device = torch.cuda.current_device()
        # One more span's words past CAPACITY: the warm-up writes there.
        stamps = torch.zeros((CAPACITY + 1) * _WORDS, dtype=torch.int64, device=device)
        try:
            clock = TritonClock(stamps)
            stream = current_raw_stream_fn()()
            clock.start(CAPACITY * _WORDS, stream)
            clock.end(CAPACITY * _WORDS, stream)
        except Exception as exc:  # a platform Triton cannot compile for: say so, go on
            self.reason = f"the stamp kernel failed to build ({type(exc).__name__}: {exc})"
            return
        self._install(stamps, clock, device)

    def use_stand_in_clock(self) -> StandInClock:
        """Tests on a CPU: time captured spans by a :class:`StandInClock` (before the
        capture). Returns it: the test's ops advance ``clock.now``."""
        stamps = torch.zeros((CAPACITY + 1) * _WORDS, dtype=torch.int64)
        clock = StandInClock(stamps)
        self._install(stamps, clock, -1)
        return clock

    def _install(self, stamps: torch.Tensor, clock: Clock, device: int) -> None:
        self.stamps, self.clock, self._device = stamps, clock, device
        self.reason = ""
        pin = stamps.is_cuda
        self._host = [
            torch.empty(CAPACITY * _WORDS, dtype=torch.int64, pin_memory=pin)
            for _ in range(HOST_BUFFERS)
        ]
        # numpy views made once: reading a landed copy is plain host memory.
        self._host_np = [h.numpy() for h in self._host]
        self._events = [torch.cuda.Event() if pin else None for _ in range(HOST_BUFFERS)]

    # -- at capture (the region's Python runs once) -------------------------------------

    @hot_path
    def mark(self, stream: int) -> GraphMark:
        """A span's start under capture: give it words and enqueue its start stamp."""
        clock = self.clock
        if clock is None:
            return GraphMark(-1, stream, self.reason)
        if self._used >= CAPACITY:
            return GraphMark(-1, stream, f"the stamp buffer is full ({CAPACITY} captured spans)")
        if self.cuda and torch.cuda.current_device() != self._device:
            return GraphMark(-1, stream, f"captured off cuda:{self._device}, where the stamps are")
        base = self._used * _WORDS
        self._used += 1
        clock.start(base, stream)
        return GraphMark(base, stream)

    @hot_path
    def mark_end(self, start: GraphMark) -> GraphMark:
        """The end of the captured span ``start`` opened: its end stamp, on its stream."""
        if start.base < 0:
            return start
        if not self._still_capturing(start.stream):
            return GraphMark(-1, start.stream, "opened inside a captured region, closed outside")
        assert self.clock is not None  # a stamped start had one
        self.clock.end(start.base, start.stream)
        return start

    @hot_path
    def crossed(self, stream: int) -> GraphMark:
        """The end of a span opened outside the capture that is closing inside it."""
        return GraphMark(-1, stream, "opened outside a captured region, closed inside")

    @hot_path
    def add(self, sid: int, name: str, end: GraphMark, nbytes: int) -> None:
        """A captured span of section ``sid`` closed: into the template, or untimed."""
        if end.base >= 0:
            self._template.append((sid, end.base, nbytes))
            self._arrays = None
            return
        self.untimed += 1
        if name not in self._warned:
            self._unwarned.setdefault(name, end.reason)

    # -- after each step (cold) ---------------------------------------------------------

    def end_step(self) -> list[tuple[int, float, int, int]]:
        """Warn about spans captured untimed; copy the words; read the landed copies.

        Returns ``(section id, ns, calls, bytes)`` per section replayed since the last
        read. Outside any capture (the recorder checks).
        """
        self._warn()
        if not self._template:
            return []
        out: list[tuple[int, float, int, int]] = []
        if len(self._pending) == HOST_BUFFERS:  # every buffer in flight: wait for the oldest
            out += self._read(self._pending.popleft(), wait=True)
        self._copy()
        while self._pending and self._pending[0].landed():
            out += self._read(self._pending.popleft(), wait=False)
        return out

    def drain(self) -> list[tuple[int, float, int, int]]:
        """Every copy still in flight, read (waits for them: the report's cold path)."""
        out: list[tuple[int, float, int, int]] = []
        while self._pending:
            out += self._read(self._pending.popleft(), wait=True)
        return out

    def _warn(self) -> None:
        if not self._unwarned:
            return
        by_reason: dict[str, list[str]] = {}
        for name, reason in self._unwarned.items():
            by_reason.setdefault(reason, []).append(name)
        self._warned.update(self._unwarned)
        self._unwarned.clear()
        what = "; ".join(f"{names} ({reason})" for reason, names in by_reason.items())
        warnings.warn(
            f"syncless.profile: sections captured in a CUDA graph that its replays will not "
            f"time: {what}. Counted in {UNTIMED_RECORD}; each section is named once.",
            RuntimeWarning,
            stacklevel=5,
        )

    def _copy(self) -> None:
        """One non-blocking copy of the used words into the next pinned buffer, on the
        current stream (after the step's replays), and an event behind it."""
        assert self.stamps is not None  # a template entry had words
        size = self._used * _WORDS
        if self._views is None or self._views[0] != size:  # a new capture: new views
            self._views = (size, self.stamps[:size], [h[:size] for h in self._host])
        _, source, targets = self._views
        turn = self._turn
        self._turn = (turn + 1) % HOST_BUFFERS
        targets[turn].copy_(source, non_blocking=source.is_cuda)
        event = self._events[turn]
        if event is not None:
            event.record()
        self._pending.append(_Copy(self._host_np[turn], event, size))

    def _read(self, copy: _Copy, wait: bool) -> list[tuple[int, float, int, int]]:
        """What ran between the previous copy and this one, per section."""
        if wait and copy.event is not None:
            copy.event.synchronize()  # cold path: landed already, but for a full ring
        size = copy.size
        delta = self._delta[:size]
        np.subtract(copy.host[:size], self._previous[:size], out=delta)
        self._previous[:size] = copy.host[:size]
        sids, bases, sizes = self._template_arrays()
        inside = bases < size  # spans captured after this copy was taken are not in it
        sids, bases, sizes = sids[inside], bases[inside], sizes[inside]
        calls = delta[bases + 2]
        if not calls.any():
            return []  # no replay since the last copy
        ns = np.bincount(sids, weights=delta[bases + 1])
        replays = np.bincount(sids, weights=calls)
        nbytes = np.bincount(sids, weights=calls * sizes)
        return [
            (int(sid), float(ns[sid]), int(replays[sid]), int(nbytes[sid]))
            for sid in np.flatnonzero(replays)
        ]

    def _template_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._arrays is None:
            table = np.array(self._template, dtype=np.int64).reshape(-1, 3)
            self._arrays = (table[:, 0], table[:, 1], table[:, 2])
        return self._arrays
