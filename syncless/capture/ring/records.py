"""The records in the device ring, oldest first: preallocated slots over a ByteRing.

The training thread reserves a slot and ring space (:meth:`RecordQueue.try_reserve`),
enqueues its device-to-device copy and marks the slot published; the drain worker
reads the oldest published slots, copies them out and releases them in order. Slots
are allocated once, so a capture grows nothing; only the drain allocates (its batches).

The queue owns the engine's one lock. It is held for host bookkeeping only (a few
microseconds), never across a device copy or a wait on the device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from syncless.capture.ring.byte_ring import ByteRing
from syncless.capture.stats import DropReason
from syncless.hot_path import hot_path

__all__ = ["READY", "RESERVED", "VOID", "WRITTEN", "Record", "RecordQueue"]

# Distinct shapes the queue keeps one torch.Size of (RecordQueue.try_reserve).
_SHAPES = 1024

# Slot states. RESERVED -> WRITTEN (copy enqueued, or left to the drain: Record.source;
# on CUDA an event marks when it lands, recorded by the capture or later by the drain:
# Record.landed) -> READY (the drain saw the copy complete) -> free. VOID: the copy
# raised, or a deferred copy's tensor changed first; the bytes are garbage and the
# record was counted as dropped, but its ring space is released in order.
RESERVED = 1
WRITTEN = 2
READY = 3
VOID = 4


class Record:
    """One captured tensor in the device ring (a reusable slot)."""

    __slots__ = (
        "dtype",
        "event",
        "handle",
        "kept",
        "landed",
        "mark",
        "meta",
        "nbytes",
        "offset",
        "ptr",
        "seq",
        "shape",
        "source",
        "span",
        "state",
        "step",
        "stream",
        "suspect",
        "tag",
        "version",
    )

    def __init__(self, event: Any) -> None:
        self.event = event  # torch.cuda.Event on CUDA, None on CPU (copies land at once)
        self.handle = event.cuda_event if event is not None else 0  # its CUevent
        # The event whose completion says this record's copy landed: its own ``event``,
        # recorded by the capture, or, for a copy enqueued without one (``None`` until
        # then), the newest such copy's event recorded on ``stream`` by the drain
        # (DrainTransfers.mark_landed). ``mark`` numbers that drain record (-1: the
        # capture's own), so one completed query covers every record it marks.
        self.landed: Any = None
        self.mark = -1
        self.stream = 0  # the raw CUstream the copy was enqueued on
        # A deferred copy (syncless.capture.ring.copier): the tensor, held until the drain
        # enqueues its copy on ``stream``, and its version counter and address at the
        # capture, which say whether it changed in between. None once copied; the
        # tensor is then ``kept`` until the record is released, so that its memory is
        # not reused before the copy has run, whatever stream the allocator frees it
        # on. ``suspect``: it changed while its copy was being enqueued, so the copy
        # may have read either; the record is dropped once the copy has landed.
        self.source: torch.Tensor | None = None
        self.kept: torch.Tensor | None = None
        self.version = 0
        self.ptr = 0
        self.suspect = False
        self.seq = -1
        self.tag = ""
        self.step: int | None = None
        self.shape: tuple[int, ...] = ()
        self.dtype = torch.uint8
        self.nbytes = 0
        self.span = 0
        self.offset = 0
        self.meta: str | None = None
        self.state = 0


class RecordQueue:
    """Record slots in FIFO order over the device ring's byte bookkeeping.

    Args:
        ring_bytes: bytes in the device ring.
        align: alignment of every record in the ring.
        max_records: slots, i.e. records in flight at most.
        make_event: creates a slot's readiness event (CUDA), or None (CPU).
    """

    def __init__(
        self,
        ring_bytes: int,
        align: int,
        max_records: int,
        make_event: Callable[[], Any] | None,
    ) -> None:
        self.ring = ByteRing(ring_bytes, align)
        self._align_mask = align - 1
        self.lock = threading.Lock()
        self._slots = [Record(make_event() if make_event else None) for _ in range(max_records)]
        self._head = 0
        self._count = 0
        self._next_seq = 0
        self._shapes: dict[torch.Size, torch.Size] = {}
        self.closed = False
        self.failed = False  # the drain worker died: nothing will be released again

    # -- the training thread ----------------------------------------------------------

    @hot_path
    def try_reserve(
        self,
        tag: str,
        step: int | None,
        tensor: torch.Tensor,
        nbytes: int,
        meta: str | None,
    ) -> tuple[Record | None, DropReason | None]:
        """A slot and ring space for ``nbytes`` of ``tensor`` (its shape and dtype go in
        the record): ``(record, None)``, or ``(None, why)``."""
        span = (nbytes + self._align_mask) & ~self._align_mask  # ByteRing.span, inlined
        with self.lock:
            if self.closed:
                return None, DropReason.CLOSED
            if self.failed:
                return None, DropReason.DRAIN_ERROR
            if span > self.ring.capacity:
                return None, DropReason.OVERSIZED
            slots = self._slots
            if self._count == len(slots):
                return None, DropReason.RECORDS_FULL
            offset = self.ring.reserve(span)
            if offset is None:
                return None, DropReason.RING_FULL
            rec = slots[(self._head + self._count) % len(slots)]
            self._count += 1
            rec.seq = self._next_seq
            self._next_seq += 1
            rec.tag = tag
            rec.step = step
            # One torch.Size per distinct shape, not per capture: each record's own kept
            # a tracked object alive until its shard was written (the collector's
            # count; docs/capture.md, "Garbage collection").
            shape = tensor.shape
            known = self._shapes.get(shape)
            if known is None:
                if len(self._shapes) >= _SHAPES:
                    self._shapes.clear()  # dynamic shapes: forget, do not grow
                self._shapes[shape] = known = shape
            rec.shape = known
            rec.dtype = tensor.dtype
            rec.nbytes = nbytes
            rec.span = span
            rec.offset = offset
            rec.meta = meta
            rec.state = RESERVED
            return rec, None

    # -- the drain worker -------------------------------------------------------------

    @property
    def max_records(self) -> int:
        """Record slots: records in flight at most."""
        return len(self._slots)

    def __len__(self) -> int:
        """Records in flight (reserved, not yet released)."""
        return self._count

    def peek(self, i: int) -> Record:
        """The ``i``-th oldest record in flight. Only the drain releases, so the slot
        stays this record until the drain releases it."""
        return self._slots[(self._head + i) % len(self._slots)]

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest record reserved so far (-1 before any)."""
        with self.lock:
            return self._next_seq - 1

    def release(self, n: int) -> None:
        """Release the ``n`` oldest records and their ring space."""
        with self.lock:
            if n > self._count:
                raise RuntimeError(f"release({n}) with {self._count} record(s) in flight")
            for _ in range(n):
                rec = self._slots[self._head]
                offset, span = self.ring.release()
                if (offset, span) != (rec.offset, rec.span):
                    raise RuntimeError(
                        f"record ring out of order: released {(offset, span)}, expected "
                        f"{(rec.offset, rec.span)} for record {rec.seq}"
                    )
                rec.state = 0
                rec.suspect = False
                rec.meta = rec.source = rec.kept = None  # references the slot no longer needs
                self._head = (self._head + 1) % len(self._slots)
                self._count -= 1

    def can_fit(self, nbytes: int) -> bool:
        """Would a record of ``nbytes`` get a slot and ring space now?"""
        with self.lock:
            return self._count < len(self._slots) and self.ring.span(nbytes) <= self.ring.largest()

    def used_bytes(self) -> int:
        with self.lock:
            return self.ring.live_bytes

    def abandon(self) -> tuple[int, int]:
        """The drain died: the records in flight will never be stored. Lets go of the
        tensors of deferred copies and returns ``(records, bytes)`` left, the copies
        that raised (already counted) left out."""
        count = nbytes = 0
        for i in range(len(self)):
            rec = self.peek(i)
            rec.source = rec.kept = None  # a deferred copy's tensor: not needed now
            if rec.state != VOID:
                count += 1
                nbytes += rec.nbytes
        return count, nbytes

    def close(self) -> None:
        """Refuse new records from now on (the drain still empties the queue)."""
        with self.lock:
            self.closed = True

    def fail(self) -> None:
        """The drain is gone: refuse new records."""
        with self.lock:
            self.failed = True
