"""The drain's transfers: the ready records they take, in flight, then finished.

A transfer takes the oldest ready records not in flight yet, whole, and copies them
into the pinned staging ring (:mod:`syncless.capture.drain.staging`). A record larger
than the staging ring goes alone (an *oversized flush*). Once a transfer's end stamp
is reached, its records' ring space is released and their staged bytes go to the
writer; a window transfer then waits for its CLOSE
(:mod:`syncless.capture.drain.window_reports`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from syncless.capture.boundary import Timeline
from syncless.capture.controller import Grant
from syncless.capture.drain.staging import StagingCopier, Transfer
from syncless.capture.drain.window_reports import WindowReporter
from syncless.capture.ring.landing import LandingMarks
from syncless.capture.ring.records import VOID, WRITTEN, Record, RecordQueue
from syncless.capture.stats import CaptureStats, DropReason
from syncless.capture.writer import Batch, SinkWriter

__all__ = ["DrainTransfers"]


class DrainTransfers:
    """The transfers in flight, oldest first, and the ring records they cover.

    Used by the drain's thread only: the worker, its windows and its batching issue
    transfers here, and the worker finishes them.
    """

    def __init__(
        self,
        *,
        queue: RecordQueue,
        staging: StagingCopier,
        timeline: Timeline,
        writer: SinkWriter,
        reporter: WindowReporter,
        stats: CaptureStats,
        copy_held: Callable[[list[Record]], list[DropReason | None]] | None = None,
    ) -> None:
        self._queue = queue
        self._staging = staging
        self._timeline = timeline
        self._writer = writer
        self._reporter = reporter
        self._stats = stats
        self.inflight: deque[Transfer] = deque()  # issued, oldest first
        self.inflight_records = 0  # ring records they cover (the oldest in the ring)
        self.inflight_span = 0  # ... and those records' ring bytes
        self._spans: deque[int] = deque()  # per transfer in flight, its records' ring bytes
        self._landing = LandingMarks(
            queue, copy_held=copy_held, lost=lambda rec, why: stats.uncapture(why, rec.nbytes)
        )

    # -- records ----------------------------------------------------------------------

    def ready(self, rec: Record) -> bool:
        return self._landing.ready(rec)

    def mark_landed(self) -> None:
        """Enqueue the copies captures deferred and record the landing events they left
        to the drain (:mod:`syncless.capture.ring.landing`); before looking at readiness."""
        self._landing.mark(self.inflight_records)

    def ready_prefix(
        self, limit: int, upto: int | None = None, stop_after: int | None = None
    ) -> list[Record]:
        """The oldest ready records whose copies fit in ``limit`` staging bytes, none
        larger than the staging ring; up to sequence number ``upto``, or just enough to
        free ``stop_after`` bytes."""
        self.mark_landed()
        out: list[Record] = []
        total = freed = 0
        capacity = self._staging.capacity
        for i in range(self.inflight_records, len(self._queue)):
            rec = self._queue.peek(i)
            if not self.ready(rec) or (upto is not None and rec.seq > upto):
                break
            size = 0 if rec.state == VOID else rec.span
            if size > capacity or total + size > limit:
                break
            out.append(rec)
            total += size
            freed += rec.span
            if stop_after is not None and freed >= stop_after:
                break
        return out

    def next_ready(self) -> bool:
        """The oldest record not in flight is ready."""
        self.mark_landed()
        i = self.inflight_records
        return len(self._queue) > i and self.ready(self._queue.peek(i))

    def wait_oldest_record(self) -> bool:
        """Wait for the oldest record not in flight if its copy into the ring has not
        landed yet (its event releases the GIL); False if there is none to wait for."""
        self.mark_landed()
        i = self.inflight_records
        if len(self._queue) <= i:
            return False
        rec = self._queue.peek(i)
        landed = rec.landed
        if rec.state == WRITTEN and landed is not None and not landed.query():
            landed.synchronize()
            return True
        return False

    def maybe_kick_writer(self) -> None:
        """Ready records wait for staging space held by the writer: have it write now."""
        i = self.inflight_records
        if len(self._queue) > i:
            rec = self._queue.peek(i)
            fits_staging = rec.span <= self._staging.capacity
            if fits_staging and self.ready(rec) and rec.span > self._staging.largest():
                self._writer.kick()

    # -- issue ------------------------------------------------------------------------

    def issue(
        self,
        records: list[Record],
        kind: str,
        grant: Grant | None = None,
        window: tuple[int, int, int] | None = None,
    ) -> None:
        """Copy ``records`` (the oldest ready ones) into staging, back to back."""
        t = self._staging.copy(records, kind)
        if t is None:
            raise RuntimeError(f"staging has no room for {kind} records (a drain bug)")
        if grant is not None and window is not None:
            t.grant = grant
            t.version, t.open_b, t.close_b = window
        self.track(t)
        self.finish()  # on CPU the copy has landed already

    def track(self, t: Transfer) -> None:
        """``t`` is in flight: it covers the oldest ring records not in flight yet."""
        first = self.inflight_records
        span = sum(self._queue.peek(i).span for i in range(first, first + t.count))
        self.inflight.append(t)
        self._spans.append(span)
        self.inflight_records += t.count
        self.inflight_span += span

    def send_oversized_head(self) -> bool:
        """Send the oldest record alone through a fresh host buffer if it is ready and
        larger than the staging ring. Only when nothing else is in flight (ring order)."""
        if self.inflight or not len(self._queue):
            return False
        self.mark_landed()
        rec = self._queue.peek(0)
        if rec.span <= self._staging.capacity or not self.ready(rec):
            return False
        if rec.state == VOID:
            self._queue.release(1)
            return True
        t = self._staging.copy_oversized(rec)
        self._stats.add("flush_oversized_count")
        self.track(t)
        self.finish()
        return True

    # -- finish -----------------------------------------------------------------------

    def finish(self) -> bool:
        """Finish every transfer whose end stamp is reached; True if any was."""
        progressed = False
        while self.inflight and self._timeline.done(self.inflight[0].end):
            self._finish_one(self.inflight.popleft())
            progressed = True
        return progressed

    def _finish_one(self, t: Transfer) -> None:
        self.inflight_records -= t.count
        self.inflight_span -= self._spans.popleft()
        if t.count:
            self._queue.release(t.count)
        elapsed = self._timeline.elapsed_s(t.start, t.end)
        self._stats.add2("d2h_count", 1, "d2h_bytes", t.moved)
        self._stats.add2(f"d2h_{t.kind}_bytes", t.moved, "d2h_ms", (elapsed or 0.0) * 1e3)
        if t.records or t.staged:
            self._writer.submit(Batch(t.records, t.data_bytes, t.staged))
        if t.grant is not None:
            self._reporter.copied(t)  # it waits for its CLOSE
