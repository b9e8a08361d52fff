"""The drain's recurring windows: which window is open, and its grant and copy.

:class:`DrainWindows` is the window side of :class:`~syncless.capture.drain.DrainWorker`.
It observes the boundary word (which window is open, which CLOSEs have passed, which
windows came and went unseen) and asks the controller for a grant per window. The
window's copy is either planned ahead and launched at the OPEN by
``advance_boundary()`` (:meth:`DrainWindows.launch_plan`, the default on CUDA) or
issued when the drain sees the OPEN. Once the CLOSE is reached the transfer is
reported to the controller (:mod:`syncless.capture.drain.window_reports`).
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from syncless.capture.boundary import BoundaryClock
from syncless.capture.controller import FlushKind, Grant, GrantController, GrantReason
from syncless.capture.drain.staging import StagingCopier, Transfer
from syncless.capture.drain.transfers import DrainTransfers
from syncless.capture.drain.window_reports import WindowReporter
from syncless.capture.ring.records import Record
from syncless.capture.stats import CaptureStats
from syncless.capture.windows import WindowPattern
from syncless.cuda_driver import stream_capturing
from syncless.hot_path import hot_path

__all__ = ["DrainWindows", "Plan"]

# A planned drain with nothing to do sleeps this long at most: whatever gives it
# something to do (a capture, a launch, a request, staging space) wakes it.
_IDLE_WAIT_S = 0.01


@dataclass(eq=False)
class Plan:
    """A window copy decided ahead of its OPEN; ``advance_boundary()`` launches it there."""

    version: int
    open_b: int
    close_b: int
    grant: Grant
    records: list[Record]


class DrainWindows:
    """The window state of one :class:`~syncless.capture.drain.DrainWorker`, and the
    window steps of its loop (see the module docstring).

    The worker owns it and calls it from its loop, on the drain's thread; it issues
    window copies through the worker's transfers. Only :meth:`launch_plan` runs on
    the framework's thread.
    """

    def __init__(
        self,
        *,
        transfers: DrainTransfers,
        boundary: BoundaryClock,
        controller: GrantController,
        controller_lock: threading.Lock,
        staging: StagingCopier,
        reporter: WindowReporter,
        stats: CaptureStats,
        wake: threading.Event,
        sleep: Callable[[float], None],
        planned: bool,
    ) -> None:
        self._transfers = transfers
        self._boundary = boundary
        self._timeline = boundary.timeline
        self._ctl = controller
        self._ctl_lock = controller_lock
        self._staging = staging
        self._reporter = reporter
        self._stats = stats
        self._wake = wake
        self._sleep = sleep  # until woken or the timeout
        self._seen = (0, 0)  # latest boundary word: (version, count)
        # The next boundary, or a window's CLOSE, last slept on.
        self._waited: tuple[int, int] | tuple[str, int, int] | None = None
        self._open: tuple[int, int, int, int, int] | None = None  # occ, pos, open, close, ver
        self._handled: tuple[int, int, int] | None = None  # (version, occ, pos) last granted
        self.occurrence = 0
        # Planned windows (CUDA): the next window's copy, decided here and launched by
        # the framework's thread when it publishes the OPEN (launch_plan), and the
        # launched transfers it hands back. Windows are planned in order from the first
        # OPEN not decided yet: (version, boundary).
        self._planned = planned
        self.plan: Plan | None = None
        self._plan_lock = threading.Lock()
        self._launched: deque[Transfer] = deque()
        self._plan_from: tuple[int, int] = (-1, 0)
        # No window of the next period granted the ready records: decide again once the
        # stream reaches this (version, count), not at every boundary before it;
        # ``advance_boundary()`` wakes the drain when it publishes count ``wake_at``.
        self._retry_at: tuple[int, int] | None = None
        self.wake_at = -1

    def active(self) -> bool:
        """Windows decide the copies now: a pattern, not suspended, no fallback."""
        with self._ctl_lock:
            ctl = self._ctl
            return ctl.pattern is not None and not ctl.suspended and not ctl.fallback

    # -- observe ------------------------------------------------------------------------

    def observe(self) -> None:
        """Read the boundary word: report the transfers whose CLOSE passed, note the
        window now open and count the windows that came and went unseen."""
        version, count = self._boundary.read()
        with self._ctl_lock:
            pattern = self._ctl.pattern
            current = self._ctl.version
            windowed = pattern is not None and not self._ctl.suspended and not self._ctl.fallback
        self._reporter.settle(version, count, windowed)
        prev = self._seen[1] if self._seen[0] == version else 0
        self._seen = (version, count)
        if not windowed or version != current or pattern is None:
            self._open = None
            return
        if self._planned:  # planned windows: decided ahead, never missed
            if count:
                self.occurrence = pattern.locate(count - 1)[0]
            return
        if count == prev or count == 0:
            return
        last = count - 1
        occurrence, position = pattern.locate(last)
        self.occurrence = occurrence
        key = None if position is None else (occurrence, position)
        missed = 0
        if self._open is not None and self._open[:2] != key:
            missed += 1  # it was open at the last look and has closed since, unserved
            self._open = None
        opened = _opens_upto(pattern, last) - _opens_upto(pattern, prev - 1)
        if opened and key is not None:
            begin, end = pattern.bounds(*key)
            if begin > prev - 1 and self._handled != (version, *key):
                missed += opened - 1
                self._open = (*key, begin, end, version)
            else:
                missed += opened
        else:
            missed += opened
        if missed:
            self._stats.add("window_missed_count", missed)

    # -- serve: grant and copy ------------------------------------------------------------

    def serve(self) -> bool:
        """Plan the next window's copy, or grant and copy the window the drain saw
        open; True if anything moved."""
        if self._planned:
            return self._plan_window()
        if self._open is None:
            return False
        occurrence, position, open_b, close_b, version = self._open
        self._open = None
        self._handled = (version, occurrence, position)
        transfers = self._transfers
        # The simulator's order: a record too large for staging goes by an oversized
        # flush (never granted), then the window gets its grant.
        while transfers.send_oversized_head():
            with self._ctl_lock:
                self._ctl.flush(FlushKind.OVERSIZED, occurrence)
        prefix = transfers.ready_prefix(self._staging.largest())
        with self._ctl_lock:
            pattern = self._ctl.pattern
            period = pattern.period if pattern is not None else 0
            last_s = self._last_duration(version, open_b, close_b, period) if prefix else None
            grant = self._ctl.grant(position, occurrence, (r.span for r in prefix), last_s)
        self._stats.add("window_grants_count")
        if grant.records == 0:
            return True
        transfers.issue(
            prefix[: grant.records],
            "window",
            grant=grant,
            window=(version, open_b, close_b),
        )
        return True

    def _last_duration(self, version: int, open_b: int, close_b: int, period: int) -> float | None:
        """This window's duration in the previous occurrence, from its boundary stamps
        (None when they are gone or it had none)."""
        if period <= 0 or open_b < period:
            return None
        boundary = self._boundary
        start = boundary.stamp(version, open_b - period)
        end = boundary.stamp(version, close_b - period)
        if start is None or end is None:
            return None
        seconds = self._timeline.elapsed_s(start, end)
        if seconds is None or seconds < 0:
            return None
        if not (
            boundary.still_owned(version, open_b - period)
            and boundary.still_owned(version, close_b - period)
        ):
            return None  # a slot reused while it was read
        return seconds

    # -- planned windows: the framework's thread launches at the OPEN -------------------

    @hot_path
    def launch_plan(self, version: int, boundary: int) -> None:
        """``advance_boundary()`` published ``boundary``: if the planned copy waits for
        it, launch it now, on the copy stream behind the boundary's stamp.

        Why the framework's thread: it is there when the OPEN is published, while a
        drain thread that reacts to the OPEN needs the GIL first, and a host-bound
        training thread keeps it for up to the 5 ms switch interval, longer than most
        windows. The launch is one stream wait, two stamps and a copy per contiguous
        run of records (a few per captured record, tens of microseconds); every other
        decision was made by the drain beforehand. The copy stream waits on an event
        already recorded, so nothing is held for a boundary not yet published (a copy
        held for a future boundary would stall ``torch.cuda.synchronize()`` until it).
        """
        plan = self.plan
        if plan is None or plan.open_b != boundary or plan.version != version:
            return
        if self._staging.stream is not None and stream_capturing():  # (a CPU build's raises)
            return  # a graph would replay the copy: the drain drops the plan
        # Held through the launch: torch ops release the GIL, and a drain that ran in
        # between would see neither the plan nor its transfer and plan the same records
        # again.
        with self._plan_lock:
            if self.plan is not plan:
                return
            self.plan = None
            t = self._staging.copy(plan.records, "window", self._boundary.stamp(version, boundary))
            if t is not None:
                t.grant = plan.grant
                t.version, t.open_b, t.close_b = version, plan.open_b, plan.close_b
                self._launched.append(t)
        self._stats.add("window_launched_count" if t is not None else "window_plan_dropped_count")
        self._wake.set()

    def absorb_launched(self) -> None:
        """Take the transfers launch_plan() made into the drain's bookkeeping."""
        with self._plan_lock:
            while self._launched:
                self._transfers.track(self._launched.popleft())

    def abandon_plan(self) -> None:
        """The drain died: nothing is launched from here on (nothing is counted either)."""
        self.plan = None

    def drop_plan(self) -> None:
        """No plan from here on; a launch that took it first is absorbed."""
        with self._plan_lock:
            dropped, self.plan = self.plan, None
        if dropped is not None:
            self._stats.add("window_plan_dropped_count")
        self.absorb_launched()

    def _plan_window(self) -> bool:
        """Decide the copy of the next window whose OPEN is not published yet.

        Windows are decided in order; one whose grant is empty (cooling down, too
        short) is passed over for the next, at most one period ahead. One window copy
        at a time: planned, launched or in flight."""
        plan = self.plan
        if plan is not None:
            published = self._boundary.published
            if self._boundary.version == plan.version and published <= plan.open_b + 1:
                return False  # its OPEN is still to come (or being launched right now)
            self.drop_plan()  # its OPEN passed unlaunched (graph capture, a new pattern)
        self.absorb_launched()  # under the lock: a launch finished, or none is under way
        if self._transfers.inflight:
            return False
        retry = self._retry_at
        if retry is not None:
            if retry[0] == self._boundary.version and self._boundary.published < retry[1]:
                return False  # the windows up to there granted nothing: not yet
            self._retry_at, self.wake_at = None, -1
        prefix = self._transfers.ready_prefix(self._staging.largest())
        if not prefix:
            return False
        with self._ctl_lock:
            pattern, version = self._ctl.pattern, self._ctl.version
        if pattern is None or self._boundary.version != version:
            return False
        first = self._boundary.published
        if self._plan_from[0] == version:
            first = max(first, self._plan_from[1])
        for occurrence, position, open_b, close_b in _windows_from(pattern, first):
            self._plan_from = (version, open_b + 1)
            last_s = self._last_duration(version, open_b, close_b, pattern.period)
            with self._ctl_lock:
                grant = self._ctl.grant(position, occurrence, (r.span for r in prefix), last_s)
            self._stats.add("window_grants_count")
            if grant.reason in (GrantReason.SUSPENDED, GrantReason.FALLBACK):
                return False  # no windows any more: the batching path takes over
            if grant.records:
                self.plan = Plan(version, open_b, close_b, grant, prefix[: grant.records])
                self._stats.add("window_planned_count")
                return True
        # A period of windows granted nothing: look again when the last of them opens.
        self._retry_at = self._plan_from
        self.wake_at = self._plan_from[1]
        return False

    # -- idle ---------------------------------------------------------------------------

    def idle(self) -> bool:
        """Windows, nothing moved: on the device, sleep until the stream reaches the
        next boundary (windows open and close only there) or, planned, see
        :meth:`_idle_planned`; True if it slept. False otherwise (windows on the CPU, a
        boundary the host has not published yet): look again after ``poll_interval_s``
        or when woken."""
        if self._planned and self._timeline.blocks and self._idle_planned():
            return True
        # Once per boundary: a stamp that was only captured in a CUDA graph (or is not
        # recorded yet) returns at once and must not become a spin.
        if self._timeline.blocks and self._waited != self._seen:
            self._waited = self._seen
            stamp = self._boundary.stamp(*self._seen)
            if stamp is not None:
                self._timeline.wait(stamp)
                return True
        return False

    def _idle_planned(self) -> bool:
        """Planned windows, nothing in flight: sleep until the next thing that can change
        what to do, once each (a window copy's CLOSE, the oldest record's copy into the
        ring, a launch or a capture, which wake the drain); False to wait for the next
        boundary instead (ready records that no window of the next period granted)."""
        awaiting = self._reporter.awaiting
        if awaiting:
            t = awaiting[0]
            stamp = self._boundary.stamp(t.version, t.close_b)
            key = ("close", t.version, t.close_b)
            if stamp is not None and self._waited != key:
                self._waited = key
                self._timeline.wait(stamp)
                return True
        if self.plan is None:
            if self._transfers.wait_oldest_record():
                return True
            if self._transfers.next_ready() and self._retry_at is None:
                return False
        self._sleep(_IDLE_WAIT_S)
        return True


def _windows_from(pattern: WindowPattern, first: int) -> list[tuple[int, int, int, int]]:
    """The windows whose OPEN boundary is ``first`` or later, one period's worth:
    ``(occurrence, position, open boundary, close boundary)``, in order."""
    occurrence, phase = divmod(first, pattern.period)
    out = []
    for occ in (occurrence, occurrence + 1):
        base = occ * pattern.period
        for position, (begin, end) in enumerate(pattern.windows):
            if occ > occurrence or begin >= phase:
                out.append((occ, position, base + begin, base + end))
    return out[: len(pattern.windows)]


def _opens_upto(pattern: WindowPattern, boundary: int) -> int:
    """How many window OPENs fall on boundaries ``0 .. boundary`` (0 if negative)."""
    if boundary < 0:
        return 0
    occurrence, phase = divmod(boundary, pattern.period)
    begins = [b for b, _ in pattern.windows]
    return occurrence * len(begins) + bisect_right(begins, phase)
