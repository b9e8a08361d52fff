"""The device ring: where each capture is copied on the training thread.

- ``byte_ring``: :class:`ByteRing`, whole aligned reservations released oldest first
  (host bookkeeping, no torch; the pinned staging ring is one too);
- ``records``: :class:`Record` slots in FIFO order over the ring, :class:`RecordQueue`;
- ``copier``: :class:`RingCopier`, the copy into the ring, or a copy deferred to the drain;
- ``landing``: :class:`LandingMarks`, when a record's copy into the ring has landed.
"""

from __future__ import annotations

from syncless.capture.ring.byte_ring import ByteRing
from syncless.capture.ring.copier import RingCopier
from syncless.capture.ring.landing import LandingMarks
from syncless.capture.ring.records import READY, RESERVED, VOID, WRITTEN, Record, RecordQueue

__all__ = [
    "READY",
    "RESERVED",
    "VOID",
    "WRITTEN",
    "ByteRing",
    "LandingMarks",
    "Record",
    "RecordQueue",
    "RingCopier",
]
