"""A FIFO byte ring: where the next record goes, in host-side bookkeeping only.

The capture engine carves two flat buffers into whole reservations: the device ring
(one reservation per captured tensor) and the pinned staging ring (one per D2H batch).
Both are used the same way: reservations are made at the tail and released oldest
first, and a reservation is never split. When it does not fit before the end of the
buffer it goes to offset 0 if the oldest live reservation leaves room there; the bytes
skipped at the end stay unused until the reservations before them are released.

No torch, no locks: the owner serialises calls (the engine holds its queue lock).
"""

from __future__ import annotations

from collections import deque

from syncless.hot_path import hot_path

__all__ = ["ByteRing"]


class ByteRing:
    """Whole, aligned reservations in ``[0, capacity)``, released in FIFO order.

    Args:
        capacity: bytes in the buffer (>= 1).
        align: every reservation starts at a multiple of ``align`` and occupies a
            multiple of it, so a record's bytes can be viewed as any dtype whose
            element size divides ``align``. A power of two.
    """

    __slots__ = ("_align", "_capacity", "_end", "_live", "_live_bytes", "_start", "_upper")

    def __init__(self, capacity: int, align: int = 1) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"ByteRing: capacity must be an integer >= 1, got {capacity!r}")
        if isinstance(align, bool) or not isinstance(align, int) or align < 1:
            raise ValueError(f"ByteRing: align must be an integer >= 1, got {align!r}")
        if align & (align - 1):
            raise ValueError(f"ByteRing: align must be a power of two, got {align}")
        self._capacity = capacity
        self._align = align
        self._live: deque[tuple[int, int]] = deque()  # (offset, span), oldest first
        self._live_bytes = 0
        self._start = 0  # offset of the oldest live reservation
        self._end = 0  # where the next reservation goes if it fits
        # While the live reservations wrap (some at the end of the buffer, newer ones from
        # offset 0), how many of them are in the upper part; None when they do not wrap.
        self._upper: int | None = None

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def align(self) -> int:
        return self._align

    @property
    def live_bytes(self) -> int:
        """Bytes held by live reservations (not counting a skipped end-of-buffer gap)."""
        return self._live_bytes

    def __len__(self) -> int:
        """Number of live reservations."""
        return len(self._live)

    def span(self, nbytes: int) -> int:
        """The bytes a reservation of ``nbytes`` occupies: rounded up to ``align``."""
        a = self._align
        return (nbytes + a - 1) // a * a

    def largest(self) -> int:
        """The largest span :meth:`reserve` would accept now."""
        if not self._live:
            return self._capacity // self._align * self._align
        if self._upper is None:
            return max(self._capacity - self._end, self._start) // self._align * self._align
        return self._start - self._end

    @hot_path
    def reserve(self, span: int) -> int | None:
        """Reserve ``span`` bytes (a multiple of ``align``); their offset, or None if full."""
        if not self._live:
            self._start = self._end = 0
            self._upper = None
        end = self._end
        if self._upper is None:
            if end + span <= self._capacity:
                offset = end
            elif span <= self._start:
                # Wrap: the reservations in [start, end) stay in the upper part.
                offset = 0
                self._upper = len(self._live)
            else:
                return None
        elif end + span <= self._start:
            offset = end
        else:
            return None
        self._end = offset + span
        self._live.append((offset, span))
        self._live_bytes += span
        return offset

    def release(self) -> tuple[int, int]:
        """Release the oldest reservation; returns its ``(offset, span)``."""
        if not self._live:
            raise RuntimeError("ByteRing.release(): nothing is reserved")
        offset, span = self._live.popleft()
        self._live_bytes -= span
        if self._upper is not None:
            self._upper -= 1
            if self._upper == 0:
                self._upper = None  # the upper part is gone: live bytes start near 0 again
        if self._live:
            self._start = self._live[0][0]
        else:
            self._start = self._end = 0
            self._upper = None
        return offset, span
