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

Eagerly (not under graph capture) the same boundary is two CUDA driver calls that keep
the GIL (:mod:`syncless.cuda_driver`): the event record, and one batch of two stream
writes (``cuStreamBatchMemOp``; two calls where the driver lacks it), the count into
the device counter and the word, which the host already knows, into the pinned word.
In the expert-parallel demo on two H200s (192 boundaries per step) the torch ops cost
15-22 ms of host time per step, the driver calls 6.97 ms (bench/RESULTS.md,
capture_windows, 3746a75 to 07d36f0, and a9d2e96). The device counter stays exact, so a
graph captured later counts on from it; once any boundary has been captured, every
later one takes the torch path, because a replay advances the device count without the
host's mirror.

On CPU the same steps run synchronously and a boundary's time is the host clock when
``advance`` is called (the clock is injectable, for tests).

The word counts boundaries published under the current version: ``count == n`` means
boundaries ``0 .. n-1`` have been reached. Defining a pattern restarts the count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from syncless.capture.windows import COUNTER_BITS, VERSION_BITS, unpack
from syncless.cuda_driver import (
    Driver,
    current_raw_stream,
    current_raw_stream_fn,
    driver,
    stream_capturing,
)
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


class _EagerBoundary:
    """One boundary as two driver calls (three without the batch call), everything they
    need bound once: 192 boundaries per step in the expert-parallel demo make every
    Python lookup on this path host time of the training step."""

    def __init__(
        self,
        drv: Driver,
        device: int,
        word: int,
        counter: int,
        events: list[int],
        write_pair: Callable[[int, int, int], int] | None,
    ) -> None:
        self._record, self._write = drv.record_fn(), drv.write_fn()
        self._word, self._counter, self._events = word, counter, events
        self._write_pair = write_pair
        self.stream = current_raw_stream_fn(device)

    @hot_path
    def publish(self, stream: int, slot: int, count: int, word: int) -> bool:
        """Stamp ``slot``, then the device count, then the host-visible word (in this
        order on ``stream``: a word seen implies its stamp and count are there)."""
        if self._record(self._events[slot], stream) != 0:
            return False
        pair = self._write_pair
        if pair is not None:  # both writes in one driver call
            return pair(stream, count, word & _U64) == 0
        write = self._write
        return (
            write(stream, self._counter, count, 0) == 0
            and write(stream, self._word, word & _U64, 0) == 0
        )


_U64 = (1 << 64) - 1


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
        self._counter_address = self._counter.data_ptr()  # never reallocated
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
        # Eager boundaries through the driver; dropped for good once a boundary is
        # captured in a CUDA graph (replays advance the device count, not the mirror).
        self._eager: _EagerBoundary | None = self._eager_path() if self._cuda else None

    def _eager_path(self) -> _EagerBoundary | None:
        """The driver path, if the driver takes a probe write of the current word (0)."""
        drv = driver()
        address = None if drv is None else drv.host_device_pointer(self._host)
        if drv is None or address is None:
            return None
        stream = current_raw_stream(self._device.index)
        for ev in self._stamps:  # torch creates each CUevent at its first record
            ev.record(torch.cuda.current_stream(self._device))
        if not drv.stream_write_u64(stream, address, 0):
            return None
        # Probe the one-call pair with the values both words hold now (0).
        pair = drv.write_pair_fn(self._counter_address, address)
        if pair is not None and pair(stream, 0, 0) != 0:
            pair = None
        return _EagerBoundary(drv, self._device.index, address, self._counter_address,
                              [ev.cuda_event for ev in self._stamps], pair)  # fmt: skip

    @hot_path
    def advance(self, stream: Any = None) -> None:
        """Publish the next boundary from ``stream`` (CUDA: the current stream if None)."""
        n = self._published
        slot = n % self._pool
        self._owner[slot] = self._version_word | n  # first: a reader re-checks it after
        if not self._cuda:
            self._stamps[slot] = self._clock()
            self._publish_word(increment=True)
        elif self._eager is None or not self._advance_eager(stream, slot, n + 1):
            # The kernels go to the counter's device's current stream by themselves; the
            # event is told that stream, whatever the current device is.
            target = torch.cuda.current_stream(self._device) if stream is None else stream
            self._stamps[slot].record(target)  # before the word: the word implies it
            if stream is None:
                self._publish_word(increment=True)
            else:
                with torch.cuda.stream(stream):
                    self._publish_word(increment=True)
        self._published = n + 1

    @hot_path
    def _advance_eager(self, stream: Any, slot: int, count: int) -> bool:
        """Stamp, device count and word by the driver; False (and the torch path from
        now on) under graph capture or if the driver refuses."""
        eager = self._eager
        assert eager is not None
        if stream_capturing():
            self._eager = None
            return False
        handle = eager.stream() if stream is None else stream.cuda_stream
        if eager.publish(handle, slot, count, self._version_word | count):
            return True
        self._eager = None
        # Whatever part went through, the torch path below then publishes count.
        if stream is None:
            self._counter.fill_(count - 1)
        else:
            with torch.cuda.stream(stream):
                self._counter.fill_(count - 1)
        return False

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
    def version(self) -> int:
        """The pattern version the host publishes boundaries under."""
        return self._version_word >> COUNTER_BITS

    @property
    def published(self) -> int:
        """Boundaries published by this process's host under the current version."""
        return self._published
