"""Boundaries published from the framework's stream, and time on the device timeline.

``BoundaryClock.advance(stream)`` is what ``engine.advance_boundary()`` runs. On CUDA it
enqueues, on the framework's stream and without any host sync:

1. a timing event from a preallocated pool (one per boundary, ``pool`` of them reused
   in turn), so window durations are measured on the device;
2. ``counter += 1`` on a device int64 scalar, in place;
3. ``word = counter | version_bits`` (the packed 16-bit version / 48-bit count, see
   :func:`syncless.capture.windows.pack`), computed on the device;
4. a non-blocking copy of ``word`` into a pinned host int64, which the drain worker
   polls: the host sees the boundary as soon as the stream reaches it.

All four are capturable in a CUDA graph (the events are created ``external=True`` so a
captured record becomes a graph node). The word is exact under graph replay.

Eagerly, steps 3 and 4 are one driver stream write instead (``cuStreamWriteValue64``
of the word the host already knows, into the pinned word): 2 us of host time where the
device word and its copy cost 65-150 us per boundary on the H200's host
(bench/RESULTS.md, the ``advance_boundary`` probe of 2026-11-30), times ~200
boundaries per step of the expert-parallel demo. The device counter is still advanced,
so a graph captured later counts on from the right value; once any boundary has been
captured, every later one takes the device path, because a replay advances the device
count without the host's mirror. Which pool
slot each boundary's event lands in is decided on the host, though, and a replay does
not run host code: the engine tags every slot with the boundary it was recorded for and
treats a boundary whose slot does not match as *not measured* (no evidence), never as a
wrong measurement.

On CPU the same steps run synchronously and a boundary's time is the host clock when
``advance`` is called (the clock is injectable, for tests).

The word counts boundaries published under the current version: ``count == n`` means
boundaries ``0 .. n-1`` have been reached. Defining a pattern restarts the count.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from syncless.capture.windows import COUNTER_BITS, VERSION_BITS, unpack
from syncless.hot_path import hot_path

__all__ = ["BoundaryClock", "DeviceTimeline", "HostTimeline", "Stamp", "Timeline"]

#: A point on a timeline: a recorded CUDA event, or host seconds (CPU).
Stamp = Any


class Timeline:
    """Time as the copies and the boundaries see it."""

    #: ``wait`` blocks until the stream reaches the stamp (else it returns at once).
    blocks = False

    def stamp(self, stream: Any = None) -> Stamp:
        """A new stamp, taken when ``stream`` reaches this point."""
        raise NotImplementedError

    def done(self, stamp: Stamp) -> bool:
        """Has the stream reached ``stamp``?"""
        raise NotImplementedError

    def elapsed_s(self, a: Stamp, b: Stamp) -> float | None:
        """Seconds from ``a`` to ``b`` (negative if ``b`` came first); None if unknown."""
        raise NotImplementedError

    def wait(self, stamp: Stamp) -> None:
        """Block this (worker) thread until the stream reaches ``stamp``."""
        raise NotImplementedError


class HostTimeline(Timeline):
    """CPU: copies are synchronous, so a stamp is the host clock when it is taken."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    def stamp(self, stream: Any = None) -> float:
        return self.clock()

    def done(self, stamp: Stamp) -> bool:
        return True

    def elapsed_s(self, a: Stamp, b: Stamp) -> float | None:
        return b - a

    def wait(self, stamp: Stamp) -> None:
        pass


class DeviceTimeline(Timeline):
    """CUDA: stamps are timing events; elapsed times come from the device clock.

    Events are ``blocking``: a drain waiting on one sleeps instead of spinning a core.
    """

    blocks = True

    def stamp(self, stream: Any = None) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True, blocking=True)
        ev.record(stream)
        return ev

    def done(self, stamp: Stamp) -> bool:
        return stamp.query()

    def wait(self, stamp: Stamp) -> None:
        stamp.synchronize()  # releases the GIL while it waits

    def elapsed_s(self, a: Stamp, b: Stamp) -> float | None:
        try:
            return a.elapsed_time(b) / 1e3
        except RuntimeError:
            # An event not reached yet, or re-recorded for a later boundary meanwhile:
            # this interval is not measured (the caller treats it as no evidence).
            return None


class HostWordWriter:
    """``cuStreamWriteValue64`` into one pinned int64: a write ordered on a stream.

    ``create`` returns None where the driver lacks it or refuses it (no stream memory
    operations on this platform): the caller keeps the device-op path.
    """

    def __init__(self, write: Any, address: int) -> None:
        self._write, self._address = write, address

    @classmethod
    def create(cls, host: torch.Tensor, device: torch.device) -> HostWordWriter | None:
        try:
            # PyDLL: the call keeps the GIL. It takes ~2 us, and every GIL release on the
            # training thread is a chance for the drain thread to take the GIL first.
            lib = ctypes.PyDLL("libcuda.so.1")
            write = lib.cuStreamWriteValue64_v2
            write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            device_ptr = ctypes.c_uint64()
            host_ptr = ctypes.c_void_p(host.data_ptr())
            if lib.cuMemHostGetDevicePointer_v2(ctypes.byref(device_ptr), host_ptr, 0) != 0:
                return None
            writer = cls(write, device_ptr.value)
            stream = torch.cuda.current_stream(device)
            if not writer.write(stream.cuda_stream, int(host[0])):  # probe: same value
                return None
            return writer
        except (OSError, AttributeError):
            return None

    def write(self, stream_handle: int, word: int) -> bool:
        """Enqueue ``word`` (the int64 bit pattern, as an unsigned value); True if the
        driver accepted it."""
        return self._write(stream_handle, self._address, word & ((1 << 64) - 1), 0) == 0


def _signed64(value: int) -> int:
    """``value`` (0 <= value < 2**64) as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


class BoundaryClock:
    """The device boundary counter, its host-visible word, and a stamp per boundary.

    Args:
        device: where the counter lives (the capture device).
        pool: stamps kept; a boundary's time can be read until ``pool`` later
            boundaries have been published.
        clock: host clock for CPU stamps.
    """

    def __init__(self, device: torch.device, pool: int, clock: Callable[[], float]) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        self._counter = torch.zeros((), dtype=torch.int64, device=device)
        self._version_bits = torch.zeros((), dtype=torch.int64, device=device)
        self._word = torch.zeros((), dtype=torch.int64, device=device)
        self._host = torch.zeros(1, dtype=torch.int64, pin_memory=self._cuda)
        self._host_view = self._host.numpy()  # what the drain polls: no torch call per read
        self._pool = pool
        self._clock = clock
        # Which boundary (as a packed word) each slot's stamp belongs to.
        self._owner: list[int] = [-1] * pool
        if self._cuda:
            self._stamps: list[Any] = [
                torch.cuda.Event(enable_timing=True, blocking=True, external=True)
                for _ in range(pool)
            ]
            self.timeline: Timeline = DeviceTimeline()
        else:
            self._stamps = [0.0] * pool
            self.timeline = HostTimeline(clock)
        self._version_word = 0  # version << COUNTER_BITS, on the host
        self._published = 0  # host mirror of the device count (eager execution)
        # Eager word writes by the driver; dropped for good once a boundary is captured
        # in a CUDA graph (replays then advance the device count without the mirror).
        self._writer = HostWordWriter.create(self._host, device) if self._cuda else None

    @hot_path
    def advance(self, stream: Any = None) -> None:
        """Publish the next boundary from ``stream`` (CUDA: the current stream if None)."""
        n = self._published
        slot = n % self._pool
        self._owner[slot] = self._version_word | n  # first: a reader re-checks it after
        if self._cuda:
            # The kernels go to the counter's device's current stream by themselves; the
            # event is told that stream, whatever the current device is.
            target = torch.cuda.current_stream(self._device) if stream is None else stream
            self._stamps[slot].record(target)  # before the word: the word implies it
            if stream is None:
                self._advance_word(target, n + 1)
            else:
                with torch.cuda.stream(stream):
                    self._advance_word(target, n + 1)
        else:
            self._stamps[slot] = self._clock()
            self._publish_word(increment=True)
        self._published = n + 1

    @hot_path
    def _advance_word(self, stream: Any, count: int) -> None:
        if self._writer is not None and torch.cuda.is_current_stream_capturing():
            self._writer = None
        if self._writer is None:
            self._publish_word(increment=True)
            return
        self._counter.add_(1)  # kept exact for a graph captured later
        if not self._writer.write(stream.cuda_stream, self._version_word | count):
            self._writer = None  # refused now: the device path from here on
            torch.bitwise_or(self._counter, self._version_bits, out=self._word)
            self._host.copy_(self._word.view(1), non_blocking=True)

    @hot_path
    def _publish_word(self, increment: bool) -> None:
        if increment:
            self._counter.add_(1)
        torch.bitwise_or(self._counter, self._version_bits, out=self._word)
        self._host.copy_(self._word.view(1), non_blocking=True)

    def set_version(self, version: int, stream: Any = None) -> None:
        """Restart the count under ``version`` (ordered on ``stream`` with the boundaries)."""
        self._version_word = version << COUNTER_BITS
        bits = _signed64(self._version_word)
        if self._cuda and stream is not None:
            with torch.cuda.stream(stream):
                self._restart(bits)
        else:
            self._restart(bits)
        self._published = 0

    def _restart(self, bits: int) -> None:
        self._counter.zero_()
        self._version_bits.fill_(bits)
        self._publish_word(increment=False)

    def read(self) -> tuple[int, int]:
        """The latest ``(version, count)`` the host can see."""
        return unpack(int(self._host_view[0]))

    def stamp(self, version: int, boundary: int) -> Stamp | None:
        """The stamp of ``boundary`` under ``version``, or None if it is no longer (or
        was never, e.g. under CUDA graph replay) the one in its slot."""
        if not 0 <= version < 1 << VERSION_BITS:
            return None
        slot = boundary % self._pool
        if self._owner[slot] != (version << COUNTER_BITS | boundary):
            return None
        return self._stamps[slot]

    def still_owned(self, version: int, boundary: int) -> bool:
        """Re-check after reading a stamp: was its slot reused meanwhile?"""
        return self._owner[boundary % self._pool] == (version << COUNTER_BITS | boundary)

    @property
    def published(self) -> int:
        """Boundaries published by this process's host under the current version."""
        return self._published
