"""Copies out of the device ring into the pinned staging ring, on a copy stream.

A transfer is the oldest ready records, whole, packed back to back into the pinned
staging ring by one copy per contiguous run of the device ring (two when the records
wrap around its end) on a dedicated copy stream, between two stamps. Records larger
than the staging ring go one by one into a fresh host buffer (an *oversized flush*).
Which records go, and when, is the drain's decision (:mod:`syncless.capture.drain.worker`).
The staging ring is locked: the writer gives space back from its own threads, and a
planned window's copy is enqueued by the framework's thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from syncless.capture.boundary import Stamp, Timeline
from syncless.capture.controller import Grant
from syncless.capture.ring.byte_ring import ByteRing
from syncless.capture.ring.records import VOID, Record
from syncless.capture.sinks.shards import CapturedRecord
from syncless.hot_path import hot_path

__all__ = ["StagedRecords", "StagingCopier", "Transfer"]


class StagedRecords:
    """A transfer's records for the sink, kept as columns until the writer iterates.

    Iterating yields one :class:`~syncless.capture.sinks.shards.CapturedRecord` per record, with
    its view of the host memory, right before the sink's ``write``: made by the drain
    at the transfer, those objects lived until their shard was written, and Python's
    collector, which counts the tracked objects alive, ran 20x as often with every layer
    of Llama-1B captured (docs/capture.md, "Garbage collection").
    """

    __slots__ = ("_columns", "_host", "_rank")

    def __init__(self, host: torch.Tensor, rank: int, records: list[Record], at: list[int]):
        self._host = host
        self._rank = rank
        self._columns = (
            [r.seq for r in records],
            [r.tag for r in records],
            [r.step for r in records],
            [r.shape for r in records],
            [r.dtype for r in records],
            [r.nbytes for r in records],
            [r.meta for r in records],
            at,
        )

    def __len__(self) -> int:
        return len(self._columns[0])

    def __iter__(self) -> Iterator[CapturedRecord]:
        host, rank = self._host, self._rank
        for seq, tag, step, shape, dtype, nbytes, meta, pos in zip(*self._columns, strict=True):
            yield CapturedRecord(
                seq, tag, step, rank, shape, dtype, nbytes, meta, host[pos : pos + nbytes]
            )


@dataclass(eq=False)
class Transfer:
    """One copy out of the device ring: its records, its stamps and, for a window, its
    grant."""

    kind: str  # window | batch | flush | oversized: the d2h_<kind>_bytes counter it feeds
    records: StagedRecords
    count: int  # ring records it releases (void ones included)
    moved: int  # bytes copied (their spans)
    data_bytes: int  # record bytes
    staged: bool
    start: Stamp
    end: Stamp
    grant: Grant | None = None
    version: int = 0
    open_b: int = 0
    close_b: int = 0
    seen_done_at: int = 0  # the boundary count when the host saw the copy done


class StagingCopier:
    """The pinned staging ring's space, and the copies of device-ring records into it."""

    def __init__(
        self,
        *,
        ring: torch.Tensor,
        staging: torch.Tensor,
        align: int,
        timeline: Timeline,
        rank: int,
    ) -> None:
        self._ring = ring
        self._staging = staging
        # On the CPU, copies are a memmove (ctypes lets go of the GIL around it): a torch
        # copy_ from this thread ran an OpenMP team of its own, whose spinning threads
        # took the cores of the training thread's team: every layer of a 16-layer model
        # captured cost its step +166% on the 2-core CI host, +23% with the memmove
        # (bench/capture/load.py --tiny --layers 16, aae33ea).
        self._host_copy = ring.device.type == "cpu"
        self._staging_ring = ByteRing(staging.numel(), align)
        self._staging_lock = threading.Lock()
        cuda = ring.device.type == "cuda"
        self.stream = torch.cuda.Stream(ring.device) if cuda else None  # the copy stream
        self._timeline = timeline
        self._rank = rank

    @property
    def capacity(self) -> int:
        """Bytes in the staging ring: a larger record goes by an oversized flush."""
        return self._staging_ring.capacity

    def largest(self) -> int:
        """The largest reservation the staging ring can take now."""
        with self._staging_lock:
            return self._staging_ring.largest()

    def used(self) -> int:
        with self._staging_lock:
            return self._staging_ring.live_bytes

    def release(self) -> None:
        """The writer is done with the oldest staged batch."""
        with self._staging_lock:
            self._staging_ring.release()

    def _context(self) -> contextlib.AbstractContextManager[Any]:
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    @hot_path
    def copy(self, records: list[Record], kind: str, after: Stamp | None = None) -> Transfer | None:
        """Enqueue the copy of ``records`` into staging (on the copy stream, behind
        ``after`` if given); None if staging has no room for them."""
        live = [r for r in records if r.state != VOID]
        moved = sum(r.span for r in live)
        base = 0
        if moved:
            with self._staging_lock:
                got = self._staging_ring.reserve(moved)
            if got is None:
                return None
            base = got
        runs, positions = _runs(live, base)
        with self._context():
            if after is not None and self.stream is not None:
                self.stream.wait_event(after)
            start = self._timeline.stamp(self.stream)
            if self._host_copy:
                ring_ptr, staging_ptr = self._ring.data_ptr(), self._staging.data_ptr()
                for dev, pos, length in runs:
                    ctypes.memmove(staging_ptr + pos, ring_ptr + dev, length)
            else:
                for dev, pos, length in runs:
                    if length:
                        self._staging[pos : pos + length].copy_(
                            self._ring[dev : dev + length], non_blocking=True
                        )
            end = self._timeline.stamp(self.stream)
        out = StagedRecords(self._staging, self._rank, live, positions)
        return Transfer(
            kind, out, len(records), moved, sum(r.nbytes for r in live), moved > 0, start, end
        )

    def copy_oversized(self, rec: Record) -> Transfer:
        """Copy ``rec``, larger than the staging ring, into a fresh host buffer, and wait
        for the copy."""
        # Pageable, allocated here and freed by the writer: pinning a one-off buffer
        # costs more than the copy it would speed up. non_blocking keeps torch's sync
        # debug mode (process-wide under no_sync()) from flagging this thread's copy; the
        # wait is the event's.
        host = torch.empty(rec.nbytes, dtype=torch.uint8)
        with self._context():
            start = self._timeline.stamp(self.stream)
            if self._host_copy:
                ctypes.memmove(host.data_ptr(), self._ring.data_ptr() + rec.offset, rec.nbytes)
            else:
                host.copy_(self._ring[rec.offset : rec.offset + rec.nbytes], non_blocking=True)
            end = self._timeline.stamp(self.stream)
        self._timeline.wait(end)
        record = StagedRecords(host, self._rank, [rec], [0])
        return Transfer("oversized", record, 1, rec.span, rec.nbytes, False, start, end)


def _runs(records: list[Record], base: int) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Records packed back to back into staging from ``base``: ``(ring offset, staging
    offset, length)`` per contiguous run of them in the device ring (one, or two when
    they wrap around its end), and each record's staging offset."""
    runs: list[tuple[int, int, int]] = []
    positions: list[int] = []
    pos = base
    for r in records:
        positions.append(pos)
        if runs and r.offset == runs[-1][0] + runs[-1][2]:
            dev, start, length = runs[-1]
            runs[-1] = (dev, start, length + r.span)
        else:
            runs.append((r.offset, pos, r.span))
        pos += r.span
    return runs, positions
