"""What the capture engine did, counted: every record is stored or dropped with a reason.

Counters are cumulative and thread-safe (the training thread, the drain worker and the
sink writer all count). :meth:`CaptureStats.deltas` turns them into per-step values for
``capture/step/*`` step records; gauges (ring occupancy) are reported as they are.

The books balance once the engine is closed::

    offered_count == stored_count + sum(dropped_<reason>_count for every reason)

and while it runs, the difference is the records still in the ring, the staging ring
or the writer (``pending_count``).
"""

from __future__ import annotations

import sys
import threading
import time
from enum import Enum

from syncless.hot_path import hot_path

__all__ = [
    "COUNTERS",
    "GAUGES",
    "SELF_COUNTERS",
    "CaptureStats",
    "DropReason",
    "ThreadClock",
    "ThreadCounts",
]


class DropReason(str, Enum):
    """Why a record was not stored. Each has its own counters."""

    #: the device ring had no room for it (``on_full="drop"``)
    RING_FULL = "ring_full"
    #: every record slot was in use (``max_records`` records in flight)
    RECORDS_FULL = "records_full"
    #: larger than the whole device ring: it can never be captured
    OVERSIZED = "oversized"
    #: captured after ``close()``
    CLOSED = "closed"
    #: the device-to-device copy into the ring raised (the error is re-raised too), or
    #: the driver refused a deferred copy
    COPY_ERROR = "copy_error"
    #: a deferred copy's tensor changed in place, or lost its storage, before the drain
    #: copied it (its version counter or address moved)
    CHANGED = "changed"
    #: the sink raised while writing it
    SINK_ERROR = "sink_error"
    #: the drain worker failed; records left in the ring were lost with it
    DRAIN_ERROR = "drain_error"


_PER_RECORD = ("offered", "captured", "stored", *(f"dropped_{r.value}" for r in DropReason))

#: Cumulative counters (reported per step as deltas).
COUNTERS: tuple[str, ...] = (
    *(f"{name}_{unit}" for name in _PER_RECORD for unit in ("count", "bytes")),
    "blocked_count",  # captures that waited for ring space (block / flush)
    "blocked_ms",  # host time they waited
    "d2h_count",  # D2H transfers (one or two copies each: two when a batch wraps)
    "d2h_bytes",  # bytes moved to the host, alignment padding included
    "d2h_ms",  # device time of those copies (CPU: host time)
    "d2h_window_bytes",  # ... inside a window grant
    "d2h_batch_bytes",  # ... by ordinary batching (no pattern, suspended, fallback)
    "d2h_flush_bytes",  # ... by flushes outside the windows (capacity, block, lifecycle)
    "d2h_oversized_bytes",  # ... by oversized flushes (records larger than staging)
    "flush_capacity_count",
    "flush_lifecycle_count",
    "flush_oversized_count",
    "window_grants_count",  # windows OPEN and handled (grants with or without records)
    "window_transfers_count",  # of those, transfers made and reported to the controller
    "window_overruns_count",  # transfers that ended at or after the CLOSE
    "window_issued_late_count",  # transfers issued late (not evidence)
    "window_close_late_count",  # CLOSEs whose device timing was lost (not evidence)
    "window_missed_count",  # windows that opened and closed before the drain saw them
    "window_planned_count",  # CUDA: window copies planned ahead of their OPEN ...
    "window_launched_count",  # ... launched by advance_boundary() at the OPEN
    "window_plan_dropped_count",  # ... dropped (a request came first, or the OPEN passed)
    "sink_shards_count",
    "sink_ms",  # time inside the sink's write, summed over writers (a rate: stored / this)
    "sink_errors_count",
    "boundary_count",  # advance_boundary() calls
    "capture_host_ms",  # host time inside capture() (the engine bills itself)
    "boundary_host_ms",  # host time inside advance_boundary()
    "drain_loops_count",  # drain iterations (each takes the GIL once at least)
    "drain_look_ms",  # their CPU time (the longest: capture/self/drain_look_max_ms)
    "drain_cpu_ms",  # CPU time of the drain thread (Linux; 0 where unknown)
    "writer_cpu_ms",  # CPU time of the sink writer thread (Linux; 0 where unknown)
)

#: Counters reported under ``capture/self/`` (the engine's own cost), not ``capture/step/``.
SELF_COUNTERS: frozenset[str] = frozenset(
    {
        "capture_host_ms",
        "boundary_host_ms",
        "drain_loops_count",
        "drain_look_ms",
        "drain_cpu_ms",
        "writer_cpu_ms",
    }
)

#: Instantaneous values (reported as they are when the step ends).
GAUGES: tuple[str, ...] = (
    "pending_count",  # captured, not yet stored or dropped
    "ring_used_bytes",
    "staging_used_bytes",
    "fallback",  # 1 once the grant controller fell back to ordinary batching
)


class ThreadCounts:
    """What ``capture()`` counts on one capturing thread: written by that thread alone,
    so without a lock (a locked update of five counters took 490 ns of a 3.5 us capture
    on the CI host). Readers add them up; one read may see a call half counted (its
    offer, not yet its capture), never a count lost."""

    __slots__ = ("captured_bytes", "captured_count", "host_ns", "offered_bytes", "offered_count")

    def __init__(self) -> None:
        self.offered_count = 0
        self.offered_bytes = 0
        self.captured_count = 0
        self.captured_bytes = 0
        self.host_ns = 0


class _PerThread(threading.local):
    """This thread's :class:`ThreadCounts`, made on its first capture and listed in
    ``registry`` (``list.append`` is atomic under the GIL) for the readers."""

    def __init__(self, registry: list[ThreadCounts]) -> None:
        self.counts = ThreadCounts()
        registry.append(self.counts)


class CaptureStats:
    """Thread-safe cumulative counters with per-step deltas."""

    __slots__ = ("_last", "_local", "_lock", "_look_max", "_threads", "_values")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._last: dict[str, float] = dict(self._values)
        self._threads: list[ThreadCounts] = []
        self._local = _PerThread(self._threads)
        self._look_max = 0.0

    @hot_path
    def thread_counts(self) -> ThreadCounts:
        """The calling thread's ``capture()`` counters (update them from it only)."""
        return self._local.counts

    @hot_path
    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._values[name] += value

    @hot_path
    def add2(self, name_a: str, a: float, name_b: str, b: float) -> None:
        """Two counters under one lock (a count and its bytes)."""
        with self._lock:
            self._values[name_a] += a
            self._values[name_b] += b

    def look(self, seconds: float) -> None:
        """One iteration of the drain, ``seconds`` of its thread's CPU time. Its Python
        holds the GIL for most of that (not for the driver calls that let go of it), so
        the longest is about the longest a training thread can have waited on the drain
        at once. CPU time, not wall time: the wall time of a look also counts its waits
        for the GIL, which the training thread held."""
        ms = seconds * 1e3
        with self._lock:
            self._values["drain_loops_count"] += 1
            self._values["drain_look_ms"] += ms
            self._look_max = max(self._look_max, ms)

    def take_look_max(self) -> float:
        """The longest drain iteration (ms) since the last call."""
        with self._lock:
            longest, self._look_max = self._look_max, 0.0
        return longest

    def uncapture(self, reason: DropReason, nbytes: int) -> None:
        """A record counted as captured is lost after all (a deferred copy)."""
        key = reason.value
        values = self._values
        with self._lock:
            values["captured_count"] -= 1
            values["captured_bytes"] -= nbytes
            values[f"dropped_{key}_count"] += 1
            values[f"dropped_{key}_bytes"] += nbytes

    @hot_path
    def drop(self, reason: DropReason, nbytes: int, count: int = 1) -> None:
        key = reason.value
        with self._lock:
            self._values[f"dropped_{key}_count"] += count
            self._values[f"dropped_{key}_bytes"] += nbytes

    def __getitem__(self, name: str) -> float:
        return self.snapshot()[name]

    def snapshot(self) -> dict[str, float]:
        """Every counter, cumulative."""
        with self._lock:
            values = dict(self._values)
        for counts in list(self._threads):
            values["offered_count"] += counts.offered_count
            values["offered_bytes"] += counts.offered_bytes
            values["captured_count"] += counts.captured_count
            values["captured_bytes"] += counts.captured_bytes
            values["capture_host_ms"] += counts.host_ns / 1e6
        return values

    def deltas(self) -> dict[str, float]:
        """Each counter's change since the previous call (the first call: since start)."""
        now = self.snapshot()
        out = {k: now[k] - self._last[k] for k in COUNTERS}
        self._last = now
        return out

    def dropped(self) -> dict[str, int]:
        """Dropped records by reason (every reason, zeros included)."""
        with self._lock:
            return {r.value: int(self._values[f"dropped_{r.value}_count"]) for r in DropReason}

    def balance(self) -> int:
        """``offered - stored - dropped``: the records still pending (0 once closed)."""
        v = self.snapshot()
        dropped = sum(v[f"dropped_{r.value}_count"] for r in DropReason)
        return int(v["offered_count"] - v["stored_count"] - dropped)


class ThreadClock:
    """The CPU time a worker thread has used, read from another thread.

    Why: on a host-bound step every millisecond a worker holds the GIL can come out of
    the training thread, so the engine reports its threads' CPU time beside its own
    host time on the training thread. Read from the reporting thread (one
    ``clock_gettime`` per thread per report), the workers pay nothing for it. Where no
    per-thread CPU clock is available (not Linux/BSD) it reads 0.
    """

    def __init__(self) -> None:
        # Keyed by the Thread object: a new thread may reuse an ended one's ident.
        self._last: dict[threading.Thread, int] = {}

    def advance(self, thread: threading.Thread | None) -> float:
        """Milliseconds of CPU ``thread`` used since the previous call for it."""
        if thread is None or not thread.is_alive():
            # join() returns before the OS thread has exited: an ended thread's clock
            # can still tick for its teardown, and then its ids are free for reuse.
            if thread is not None:
                self._last.pop(thread, None)
            return 0.0
        clock = _cpu_clock_id(thread)
        if clock is None:
            return 0.0
        try:
            now = time.clock_gettime_ns(clock)
        except OSError:  # the thread ended meanwhile
            return 0.0
        before = self._last.get(thread, 0)
        self._last[thread] = now
        return (now - before) / 1e6


def _cpu_clock_id(thread: threading.Thread) -> int | None:
    """The per-thread CPU clock of ``thread``, or None where there is none."""
    if sys.platform == "linux" and thread.native_id is not None:
        # Linux's clock id for a TID (glibc's MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)).
        # From the TID, not the pthread_t: Python's threads are detached, so the
        # pthread_t of a thread that has just exited points at freed memory, and the
        # kernel answers EINVAL for a TID that is not a thread of this process.
        return (~thread.native_id << 3) | 6
    getter = getattr(time, "pthread_getcpuclockid", None)
    return None if getter is None or thread.ident is None else getter(thread.ident)
