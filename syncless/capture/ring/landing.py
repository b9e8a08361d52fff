"""When a record's copy into the device ring has landed: its landing event.

A capture enqueues its copy on the training stream. Either it records its own slot's
event right after (:mod:`syncless.capture.ring.copier`, planned windows), or it leaves
``Record.landed`` empty and the drain records one event per stream later, after the
newest such copy (:meth:`LandingMarks.mark`): a stream reaches that event only after
every copy enqueued on it before, so one event covers them all. That saves the
training thread a driver call per capture; the batching drain waits for the newest
record it gathered anyway, so the event lands at about the same time.

A deferred copy (``Record.source``, :mod:`syncless.capture.ring.copier`) is enqueued here
too, on its capture's stream, just before that stream's landing event. Neither is
enqueued on a stream that is being captured into a CUDA graph (the user's
``torch.cuda.graph`` or ``torch.compile(mode="reduce-overhead")``): it would join the
graph and run at every replay. Those records wait for the drain's next look.

Used by the drain's thread only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from syncless.capture.ring.records import READY, RESERVED, VOID, WRITTEN, Record, RecordQueue
from syncless.capture.stats import DropReason
from syncless.cuda_driver import driver
from syncless.guard import allow_sync

__all__ = ["LandingMarks"]


class LandingMarks:
    """Landing events the drain records for deferred copies, and readiness queries.

    Args:
        queue: the engine's records.
        record: ``record(cuevent, custream) -> status`` (default: the CUDA driver's
            ``cuEventRecord``, looked up at the first deferred record).
        wait_device: waits for every stream, where the driver refused ``record``
            (default ``torch.cuda.synchronize``).
        capturing: ``capturing(custream) -> bool``, is the stream in CUDA graph
            capture (default: the driver's ``cuStreamIsCapturing``).
        copy_held: enqueues one stream's deferred copies and says, per record, why
            not, if it did not (:meth:`RingCopier.copy_held <syncless.capture.ring.copier.
            RingCopier.copy_held>`); required once a record holds its tensor.
        lost: told of a deferred record that could not be copied (counts the drop).
    """

    def __init__(
        self,
        queue: RecordQueue,
        record: Callable[[int, int], int] | None = None,
        wait_device: Callable[[], None] | None = None,
        *,
        capturing: Callable[[int], bool] | None = None,
        copy_held: Callable[[list[Record]], list[DropReason | None]] | None = None,
        lost: Callable[[Record, DropReason], None] | None = None,
    ) -> None:
        self._queue = queue
        self._record = record
        self._wait_device = wait_device or torch.cuda.synchronize
        self._capturing = capturing
        self._copy_held = copy_held
        self._lost = lost
        self._marked_seq = -1  # every record up to this one has its landing event
        self._marks = 0  # landing events recorded by the drain so far (Record.mark)
        self._done: dict[int, int] = {}  # per stream, the newest mark seen complete

    def ready(self, rec: Record) -> bool:
        """Has ``rec``'s copy landed? Sets it READY when it has (VOID, if its tensor
        changed while its deferred copy was being enqueued)."""
        state = rec.state
        if state in (READY, VOID):
            return True
        if state != WRITTEN or rec.source is not None:
            return False  # its copy is being enqueued right now, or is deferred to mark()
        mark = rec.mark
        if rec.event is None or (mark >= 0 and mark <= self._done.get(rec.stream, -1)):
            self._landed(rec)  # a CPU copy, or one a mark already seen complete covers
            return True
        landed = rec.landed
        if landed is None or not landed.query():
            return False  # deferred and not marked yet, or not landed
        if mark >= 0:
            self._done[rec.stream] = mark  # one stream's marks complete in order
        self._landed(rec)
        return True

    def _landed(self, rec: Record) -> None:
        if rec.suspect:
            self._void(rec, DropReason.CHANGED)
        else:
            rec.state = READY

    def _void(self, rec: Record, why: DropReason) -> None:
        rec.state = VOID
        if self._lost is not None:
            self._lost(rec, why)

    def mark(self, start: int) -> None:
        """Enqueue deferred copies and record the landing events of copies that have
        none, from the ``start``-th oldest record on: per stream, one event after the
        newest. Cheap when nothing new was captured since the last call."""
        queue = self._queue
        n = len(queue)
        if n == 0:
            return
        start = max(start, self._marked_seq + 1 - queue.peek(0).seq)
        held: dict[int, list[Record]] = {}  # deferred copies to enqueue, per stream
        pending: list[Record] = []  # copies to record landing events for
        capturing: dict[int, bool] = {}  # per stream, for this look
        for i in range(start, n):
            rec = queue.peek(i)
            if rec.state == RESERVED:
                break  # its copy is being enqueued right now: the next call marks it
            if rec.state == WRITTEN and rec.landed is None:
                cuda = rec.event is not None
                if cuda and self._in_graph_capture(rec.stream, capturing):
                    break  # not into the user's graph: the next look, after its capture
                if rec.source is not None:
                    held.setdefault(rec.stream, []).append(rec)
                elif cuda:
                    pending.append(rec)
            self._marked_seq = rec.seq
        for records in held.values():
            pending += self._copy(records)
        if not pending:
            return
        newest: dict[int, Record] = {}
        for rec in pending:
            last = newest.get(rec.stream)
            if last is None or rec.seq > last.seq:
                newest[rec.stream] = rec
        if self._record is None:
            self._record = driver().record_fn()
        marks: dict[int, int] = {}
        for stream, rec in newest.items():
            if self._record(rec.handle, stream) == 0:
                self._marks += 1
                marks[stream] = self._marks
        for rec in pending:
            mark = marks.get(rec.stream)
            if mark is not None:
                rec.landed, rec.mark = newest[rec.stream].event, mark
        if len(marks) < len(newest):
            self._land_by_sync([r for r in pending if r.stream not in marks])

    def _in_graph_capture(self, stream: int, seen: dict[int, bool]) -> bool:
        busy = seen.get(stream)
        if busy is None:
            if self._capturing is None:
                drv = driver()
                self._capturing = drv.stream_capturing_fn() if drv is not None else _never
            busy = seen[stream] = self._capturing(stream)
        return busy

    def _copy(self, records: list[Record]) -> list[Record]:
        """Enqueue one stream's deferred copies; the CUDA ones enqueued, to be marked.
        One not copied is void now; one whose tensor changed while its copy was being
        enqueued (``suspect``) once that copy has landed, so that no late copy writes
        into ring space given to another record."""
        if self._copy_held is None:
            raise RuntimeError("a capture deferred its copy to a drain that cannot copy")
        copied = []
        for rec, why in zip(records, self._copy_held(records), strict=True):
            if why is None or rec.suspect:
                if rec.event is not None:
                    copied.append(rec)
                elif rec.suspect:
                    self._void(rec, DropReason.CHANGED)  # a CPU copy is done already
            else:
                self._void(rec, why)
        return copied

    def _land_by_sync(self, records: list[Record]) -> None:
        """The driver refused an event on their stream (one destroyed since the
        capture?): wait for the whole device, on the drain's thread, instead."""
        with allow_sync("capture drain: the driver refused a landing event; waiting on the device"):
            self._wait_device()
        for rec in records:
            self._landed(rec)


def _never(stream: int) -> bool:
    return False
