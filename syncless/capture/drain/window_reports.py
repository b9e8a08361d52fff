"""Window transfers reported to the grant controller once their CLOSE is reached.

The engine measures and reports; the controller decides. For a window transfer the
engine reports, from the device timeline (host clock on CPU): ``before_close`` (the
copy ended before the CLOSE boundary's stamp), ``issued_late`` (the copy started more
than ``late_issue_s`` after the OPEN, or the OPEN's stamp was lost), ``close_late``
(the CLOSE's stamp was lost, e.g. overwritten after ``boundary_pool`` more boundaries:
then ``before_close`` is only the host's observation), ``transfer_s`` and ``window_s``.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple

from syncless.capture.boundary import BoundaryClock
from syncless.capture.controller import GrantController
from syncless.capture.drain.staging import Transfer
from syncless.capture.stats import CaptureStats

__all__ = ["WindowReport", "WindowReporter"]


class WindowReport(NamedTuple):
    """What the engine reported to the controller for one window transfer."""

    occurrence: int
    position: int
    budget: int  # the controller's budget for the window
    granted_bytes: int  # the grant (a whole-record prefix of the ready records)
    granted_records: int
    probe: bool  # the first record alone, larger than the budget
    moved_bytes: int  # bytes the copy moved
    before_close: bool
    issued_late: bool
    close_late: bool
    transfer_s: float | None
    window_s: float | None
    outcome: str


class WindowReporter:
    """Window transfers whose copy is done, until their CLOSE; then their reports.

    The drain's transfers call :meth:`copied` when a window copy is finished, its
    windows call :meth:`settle` at each look at the boundary word, and the worker calls
    :meth:`abandon` when it stops. The latest reports are kept in :attr:`reports`.
    """

    def __init__(
        self,
        *,
        boundary: BoundaryClock,
        controller: GrantController,
        controller_lock: threading.Lock,
        stats: CaptureStats,
        late_issue_s: float,
        reports: int,
    ) -> None:
        self._boundary = boundary
        self._timeline = boundary.timeline
        self._ctl = controller
        self._ctl_lock = controller_lock
        self._stats = stats
        self._late_issue_s = late_issue_s
        self.awaiting: list[Transfer] = []  # window transfers done, CLOSE not yet seen
        self.reports: deque[WindowReport] = deque(maxlen=reports)

    def copied(self, t: Transfer) -> None:
        """A window transfer's copy is done: it waits for its CLOSE."""
        version, count = self._boundary.read()
        t.seen_done_at = count if version == t.version else t.close_b + 1
        self.awaiting.append(t)

    def settle(self, version: int, count: int, windowed: bool) -> None:
        """The boundary word reads ``(version, count)``: report every transfer whose
        CLOSE has been reached, or whose window was cut short."""
        if self.awaiting:
            keep = []
            for t in self.awaiting:
                if windowed and t.version == version and count <= t.close_b:
                    keep.append(t)  # its CLOSE has not been reached yet
                else:
                    # CLOSE reached, or the window was cut short (suspend, fallback, new
                    # pattern): the controller decides what the completion is worth.
                    self._complete(t, forced=not (t.version == version and count > t.close_b))
            self.awaiting = keep

    def abandon(self, report: bool) -> None:
        """The drain stopped: report (if ``report``) every transfer still waiting for
        its CLOSE as not evidence, and forget them."""
        if report:
            for t in self.awaiting:
                self._complete(t, forced=True)
        self.awaiting.clear()

    def _complete(self, t: Transfer, forced: bool) -> None:
        """Report a window transfer to the controller, measured as well as it can be."""
        boundary, timeline, grant = self._boundary, self._timeline, t.grant
        assert grant is not None
        open_stamp = boundary.stamp(t.version, t.open_b)
        issued_late = True
        window_s = None
        if open_stamp is not None:
            delay = timeline.elapsed_s(open_stamp, t.start)
            if delay is not None and boundary.still_owned(t.version, t.open_b):
                # Started before its OPEN (a stamp reused meanwhile): no evidence either.
                issued_late = delay > self._late_issue_s or delay < 0
        transfer_s = timeline.elapsed_s(t.start, t.end)
        # Host observation, used only when the CLOSE's stamp is lost (then close_late).
        before_close = t.seen_done_at <= t.close_b
        close_late = True
        close_stamp = None if forced else boundary.stamp(t.version, t.close_b)
        if close_stamp is not None:
            margin = timeline.elapsed_s(t.end, close_stamp)
            window = None if open_stamp is None else timeline.elapsed_s(open_stamp, close_stamp)
            if margin is not None and boundary.still_owned(t.version, t.close_b):
                close_late = False
                before_close = margin > 0  # ending exactly at the CLOSE is an overrun
                if window is not None and boundary.still_owned(t.version, t.open_b):
                    window_s = window
        if transfer_s is not None and transfer_s < 0:
            transfer_s = None
        if window_s is not None and window_s < 0:
            window_s = None
        with self._ctl_lock:
            outcome = self._ctl.complete(
                grant,
                before_close=before_close,
                issued_late=issued_late,
                close_late=close_late,
                transfer_s=transfer_s,
                window_s=window_s,
            )
        stats = self._stats
        stats.add("window_transfers_count")
        stats.add("window_overruns_count", int(not before_close))
        stats.add("window_issued_late_count", int(issued_late))
        stats.add("window_close_late_count", int(close_late))
        self.reports.append(
            WindowReport(
                grant.occurrence,
                grant.position,
                grant.budget,
                grant.nbytes,
                grant.records,
                grant.probe,
                t.moved,
                before_close,
                issued_late,
                close_late,
                transfer_s,
                window_s,
                outcome.value,
            )
        )
