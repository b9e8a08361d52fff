"""Landing events the drain records for copies captured without one
(syncless.capture.ring.landing), against a hand-run model of the streams: an event recorded
on a stream completes when the test says that stream got there."""

from __future__ import annotations

import itertools

import torch

from syncless.capture.ring.landing import LandingMarks
from syncless.capture.ring.records import READY, VOID, WRITTEN, Record, RecordQueue
from syncless.capture.stats import DropReason


class FakeEvent:
    """A CUevent stand-in: ``done`` is set by the test, ``query`` counts its calls."""

    def __init__(self, handle: int) -> None:
        self.cuda_event = handle
        self.done = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


class FakeDriver:
    """Records ``cuEventRecord(event, stream)`` calls (a recorded event is pending
    again, as CUDA's); refuses the streams in ``refuse``."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.calls: list[tuple[int, int]] = []
        self.events: dict[int, FakeEvent] = {}
        self.refuse = refuse
        self.waits = 0

    def event(self, handle: int) -> FakeEvent:
        self.events[handle] = FakeEvent(handle)
        return self.events[handle]

    def record(self, handle: int, stream: int) -> int:
        self.calls.append((handle, stream))
        if stream in self.refuse:
            return 1
        self.events[handle].done = False
        return 0

    def wait(self) -> None:
        self.waits += 1


def make(slots: int = 8, refuse: tuple[int, ...] = (), **kwargs):
    # The streams here are made-up ints: never let the real cuStreamIsCapturing see them.
    kwargs.setdefault("capturing", lambda stream: False)
    handles = itertools.count(100)
    drv = FakeDriver(refuse)
    queue = RecordQueue(1 << 16, 256, slots, lambda: drv.event(next(handles)))
    return queue, drv, LandingMarks(queue, drv.record, drv.wait, **kwargs)


def capture(queue: RecordQueue, stream: int | None, *, written: bool = True):
    """A capture as the copier leaves it: deferred on ``stream``, or (None) with its
    own event recorded."""
    rec, why = queue.try_reserve("t", 0, torch.empty(4), 16, None)
    assert rec is not None, why
    if stream is None:
        rec.landed, rec.mark = rec.event, -1
    else:
        rec.landed, rec.stream, rec.mark = None, stream, -1
    if written:
        rec.state = WRITTEN
    return rec


def test_one_event_per_stream_after_its_newest_copy() -> None:
    queue, drv, marks = make()
    a = [capture(queue, 7) for _ in range(3)]
    b = capture(queue, 9)
    own = capture(queue, None)
    assert not any(marks.ready(r) for r in [*a, b])  # nothing marked: nothing ready
    marks.mark(0)
    assert drv.calls == [(a[2].handle, 7), (b.handle, 9)]
    assert not any(marks.ready(r) for r in [*a, b, own])
    a[2].event.done = True  # stream 7 reached its event: every copy before it landed
    before = a[2].event.queries
    assert [marks.ready(r) for r in [*a, b]] == [True, True, True, False]
    assert a[2].event.queries == before + 1  # one query answers for the whole group
    b.event.done = True
    own.event.done = True
    assert marks.ready(b) and marks.ready(own)
    assert all(r.state == READY for r in [*a, b, own])
    marks.mark(0)
    assert len(drv.calls) == 2  # nothing new: no more driver calls


def test_a_copy_still_being_enqueued_stops_the_marks() -> None:
    queue, drv, marks = make()
    first = capture(queue, 7)
    busy = capture(queue, 7, written=False)  # RESERVED: its copy is not enqueued yet
    later = capture(queue, 7)
    marks.mark(0)
    assert drv.calls == [(first.handle, 7)]
    busy.state = WRITTEN
    marks.mark(0)
    assert drv.calls[1:] == [(later.handle, 7)]  # covers busy and later, once
    later.event.done = True
    assert marks.ready(busy) and marks.ready(later)
    # The stream reached the later event, so the earlier one too: no query needed.
    queries = first.event.queries
    assert marks.ready(first) and first.event.queries == queries


def test_a_reused_slot_does_not_inherit_a_completed_mark() -> None:
    queue, _, marks = make(slots=2)
    old = [capture(queue, 7), capture(queue, 7)]
    marks.mark(0)
    old[1].event.done = True
    assert all(marks.ready(r) for r in old)
    queue.release(2)
    new = [capture(queue, 7), capture(queue, 7)]  # the same two slots, deferred again
    assert not any(marks.ready(r) for r in new)
    marks.mark(0)
    assert not any(marks.ready(r) for r in new)  # the slot's event is recorded anew
    new[1].event.done = True
    assert all(marks.ready(r) for r in new)


def test_a_refused_record_waits_for_the_device_on_the_drain() -> None:
    queue, drv, marks = make(refuse=(9,))
    ok, refused = capture(queue, 7), capture(queue, 9)
    marks.mark(0)
    assert drv.waits == 1 and refused.state == READY and marks.ready(refused)
    assert not marks.ready(ok)


def test_no_event_is_recorded_on_a_stream_in_graph_capture_until_it_ends() -> None:
    in_capture = {9}
    queue, drv, marks = make(capturing=lambda stream: stream in in_capture)
    first, captured, after = capture(queue, 7), capture(queue, 9), capture(queue, 7)
    marks.mark(0)
    # Stream 9 is being captured: its record, and every one after it, wait (in order).
    assert drv.calls == [(first.handle, 7)]
    in_capture.clear()
    marks.mark(0)
    assert drv.calls[1:] == [(captured.handle, 9), (after.handle, 7)]


def test_deferred_copies_go_before_their_streams_landing_event() -> None:
    log: list[tuple] = []
    lost: list[tuple[int, DropReason]] = []

    def copy_held(records: list[Record]) -> list[DropReason | None]:
        log.append(("copy", tuple(r.seq for r in records), records[0].stream))
        for rec in records:
            rec.source = None
        return [DropReason.CHANGED if r.seq == 2 else None for r in records]

    queue, drv, marks = make(copy_held=copy_held, lost=lambda r, why: lost.append((r.seq, why)))
    recs = [capture(queue, 7 if i % 2 == 0 else 9) for i in range(4)]
    for rec in recs:
        rec.source = torch.zeros(4)  # held: the drain is to copy it
    assert not any(marks.ready(r) for r in recs)  # never ready before its copy
    drv.calls = log  # one log for copies and event records, in call order
    marks.mark(0)
    assert log == [
        ("copy", (0, 2), 7),  # one call per stream; 2 changed: void, counted as lost
        ("copy", (1, 3), 9),
        (recs[0].handle, 7),  # so stream 7's newest copy is 0
        (recs[3].handle, 9),
    ]
    assert lost == [(2, DropReason.CHANGED)] and recs[2].state == VOID
    assert marks.ready(recs[2])  # a void record is released in order, bytes ignored
    recs[0].event.done = recs[3].event.done = True
    assert all(marks.ready(r) for r in recs)
    marks.mark(0)
    assert len(log) == 4  # copied once


def test_a_copy_suspected_of_a_change_is_dropped_only_once_it_has_landed() -> None:
    """Its copy was enqueued: its ring bytes stay taken until that copy lands, or a
    late copy could write into space given to the next record."""
    lost: list[int] = []

    def copy_held(records: list[Record]) -> list[DropReason | None]:
        for rec in records:
            rec.source = None
        records[0].suspect = True  # changed while its copy was enqueued
        return [DropReason.CHANGED, None]

    queue, drv, marks = make(copy_held=copy_held, lost=lambda r, why: lost.append(r.seq))
    suspect, fine = capture(queue, 7), capture(queue, 7)
    suspect.source = fine.source = torch.zeros(4)
    marks.mark(0)
    assert drv.calls == [(fine.handle, 7)]  # one landing event covers both copies
    assert not marks.ready(suspect) and lost == []  # in flight: still holds its space
    fine.event.done = True
    assert marks.ready(suspect) and suspect.state == VOID and lost == [0]
    assert marks.ready(fine) and fine.state == READY
