"""Copies into the device ring: one per ``capture()``, on the training thread, or
deferred to the drain's.

On CUDA a contiguous tensor is copied by ``cuMemcpyDtoDAsync`` and its readiness
event recorded by ``cuEventRecord``, both through ``ctypes.PyDLL``, which keeps the
GIL. A torch ``copy_`` and ``Event.record`` each release it around their C++ body,
and every release lets the drain or writer thread take the GIL from the training
thread (see :mod:`syncless.cuda_driver`): on the H200 a 4 KiB ``capture()`` cost 37 us
with torch's calls while those threads ran (bench/capture/drain.py, 0a153bf).
Everything else (strided views, conjugate and negative bits, the CPU, a driver that
refuses) takes torch's path, which gives the same bytes in row-major order.

The copy is the floor of a capture's host time: 5-8 us of the H200 host per
``cuMemcpyDtoDAsync`` (bench/RESULTS.md, driver_calls). A launch of our own copy kernel through
``cuLaunchKernel`` was tried instead and cost as much or more (8.31 against 8.26 us at
4 KiB, 11.06 against 6.76 us at 32 MiB; copy_probe, 0c6faa0), so it is not used.

``defer``: the driver's copy records no event; the drain records one later on the same
stream, after the newest such copy (:meth:`DrainTransfers.mark_landed
<syncless.capture.drain.transfers.DrainTransfers.mark_landed>`). A batching drain waits
for the newest record it gathered anyway, so that event lands at about the same time
and the training thread makes one driver call per capture instead of two. The engine
defers only while the drain batches: in planned windows a late event could also cover
a collective the host enqueued after the capture, and hold the record past its window.

``defer_copy`` (:class:`~syncless.capture.config.EngineConfig`'s ``defer_copy_below``,
or ``capture(defer=True)``): the training thread makes no driver call at all. The
record keeps the tensor, its version counter and its address (:meth:`RingCopier.hold`),
and the drain enqueues the copy later, on the same stream, before it records the
landing event (:meth:`RingCopier.copy_held`, one ``cuMemcpyBatchAsync`` per stream and
look where the driver has it). Nothing can free the tensor meanwhile, but the training
thread can change it: a change its version counter or address shows drops the record
(``changed``); one they do not show (an in-place collective, a write through ``.data``
or a raw pointer) is copied as changed. So it is the caller's choice, off by default:
see docs/capture.md, "Deferred copies".
"""

from __future__ import annotations

import ctypes
import functools

import torch

from syncless.capture.ring.records import Record
from syncless.capture.stats import DropReason
from syncless.cuda_driver import current_raw_stream_fn, driver
from syncless.hot_path import hot_path

__all__ = ["RingCopier"]


class RingCopier:
    """Copies a tensor into its record's slice of ``ring`` on the current stream and
    records the record's event after it, unless the drain is to (``defer``); or holds
    it for the drain to copy (``defer_copy``, :meth:`copy_held`)."""

    def __init__(self, ring: torch.Tensor) -> None:
        self._ring = ring
        self._device = ring.device
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        cuda = ring.device.type == "cuda"
        drv = driver() if cuda else None
        self._ring_ptr = ring.data_ptr()
        self._memcpy = drv.memcpy_fn() if drv is not None else None
        if drv is not None and self._memcpy is not None:
            self._record = drv.record_fn()
        # ``stream()``: the raw current stream copies are enqueued on (0 on the CPU).
        self.stream = current_raw_stream_fn(ring.device.index) if cuda else _no_stream
        # Deferred copies: the driver's on CUDA; on the CPU a memmove on the drain's
        # thread (ctypes releases the GIL around it), which saves a training thread the
        # copy as well.
        self._held_copy = self._memcpy if cuda else _host_copy
        self._copy_batch = drv.memcpy_batch_fn(ring.device.index) if drv is not None else None
        self._legacy_twin: int | None = None  # made by the drain's thread, at first use

    @hot_path
    def copy(
        self,
        rec: Record,
        tensor: torch.Tensor,
        stream: int,
        defer: bool = False,
        defer_copy: bool = False,
    ) -> None:
        """Enqueue the copy on ``stream`` (the current one, from :attr:`stream`), or with
        ``defer_copy`` (and ``defer``) leave it to the drain where it can (:meth:`hold`);
        on CUDA set ``rec.landed`` (``None`` when ``defer`` left its event to the drain,
        see the module docstring)."""
        if defer_copy and defer and self._held_copy is not None and self.hold(rec, tensor, stream):
            return
        if self._memcpy is not None and self._driver_copy(rec, tensor, stream, defer):
            return
        self.view(rec).copy_(tensor.detach())
        if rec.event is not None:
            rec.event.record(torch.cuda.current_stream(self._device))
            rec.landed, rec.mark = rec.event, -1

    @hot_path
    def _driver_copy(self, rec: Record, tensor: torch.Tensor, stream: int, defer: bool) -> bool:
        """The driver's copy (and record unless ``defer``); False to take torch's path
        instead (a layout a flat copy would scramble, or a call the driver refused)."""
        if not _flat(tensor):
            return False
        n = rec.nbytes
        if n and self._memcpy(self._ring_ptr + rec.offset, tensor.data_ptr(), n, stream) != 0:
            return False
        if defer:
            rec.landed, rec.stream, rec.mark = None, stream, -1
            return True
        if self._record(rec.handle, stream) != 0:
            return False
        rec.landed, rec.mark = rec.event, -1
        return True

    @hot_path
    def hold(self, rec: Record, tensor: torch.Tensor, stream: int) -> bool:
        """A deferred copy: keep the tensor, its version counter and address in the
        record, for :meth:`copy_held` on the drain's thread; False where the driver
        could not copy it flat, or where an inference tensor has no version counter to
        tell a change by."""
        if not _flat(tensor) or tensor.is_inference():
            return False
        rec.source = tensor
        rec.version = tensor._version
        rec.ptr = tensor.data_ptr()
        rec.landed, rec.stream, rec.mark = None, stream, -1
        return True

    def copy_held(self, records: list[Record]) -> list[DropReason | None]:
        """Enqueue deferred copies captured on one stream, from the drain's thread; per
        record, why it was not copied, if it was not.

        Each tensor is checked before its copy is enqueued (changed: not copied) and
        again after (changed meanwhile: ``rec.suspect``, the copy is enqueued but the
        record is dropped once it lands). Torch bumps the version counter right after
        it enqueues an in-place kernel, and releases the GIL around the op, so the
        change can land between the first check and the copy. A copied tensor is
        ``kept`` until its record is released.

        On CUDA one ``cuMemcpyBatchAsync`` takes them all where the driver has it: it
        releases the GIL, where a copy each holds it (see :mod:`syncless.cuda_driver`);
        one copy each otherwise, or if the batch is refused."""
        reasons: list[DropReason | None] = []
        live = []
        for i, rec in enumerate(records):
            source, rec.source = rec.source, None
            if _changed(source, rec):
                reasons.append(DropReason.CHANGED)
                continue
            reasons.append(None)
            rec.kept = source
            if rec.nbytes:
                live.append(i)
        if live:
            self._enqueue(records, live, reasons)
        for i, rec in enumerate(records):
            if reasons[i] is None and _changed(rec.kept, rec):
                rec.suspect = True
                reasons[i] = DropReason.CHANGED
        return reasons

    def _enqueue(
        self, records: list[Record], live: list[int], reasons: list[DropReason | None]
    ) -> None:
        ring, stream = self._ring_ptr, records[live[0]].stream
        if self._copy_batch is not None and len(live) > 1:
            dsts = [ring + records[i].offset for i in live]
            srcs = [records[i].ptr for i in live]
            sizes = [records[i].nbytes for i in live]
            if self._copy_batch(dsts, srcs, sizes, self._batch_stream(stream)) == 0:
                return
        for i in live:
            rec = records[i]
            if self._held_copy(ring + rec.offset, rec.ptr, rec.nbytes, stream) != 0:
                reasons[i] = DropReason.COPY_ERROR
                rec.kept = None  # nothing reads it

    def _batch_stream(self, stream: int) -> int:
        """Where a batch of copies for ``stream`` goes: the stream itself, or for the
        legacy default stream (which ``cuMemcpyBatchAsync`` refuses) a blocking stream,
        ordered with it as the stream itself would be."""
        if stream != 0:
            return stream
        if self._legacy_twin is None:
            drv = driver()
            self._legacy_twin = (drv.create_blocking_stream() if drv else None) or 0
        return self._legacy_twin

    @hot_path
    def view(self, rec: Record) -> torch.Tensor:
        """The record's ring bytes as its dtype and shape: one ``as_strided`` of a view
        of the ring typed once per dtype, one torch call where a byte slice viewed twice
        is three. Records start at multiples of the ring's alignment, which every
        element size divides."""
        dtype = rec.dtype
        typed = self._typed.get(dtype)
        if typed is None:
            size = dtype.itemsize
            n = self._ring.numel()
            typed = self._ring[: n - n % size].view(dtype)
            self._typed[dtype] = typed
        return typed.as_strided(
            rec.shape, _contiguous_strides(rec.shape), rec.offset // dtype.itemsize
        )


def _flat(tensor: torch.Tensor) -> bool:
    """Can the driver copy its bytes as they lie: contiguous, no conjugate or negative
    bit (torch's views that materialise only on use)."""
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def _changed(tensor: torch.Tensor | None, rec: Record) -> bool:
    return tensor is None or tensor._version != rec.version or tensor.data_ptr() != rec.ptr


def _host_copy(dst: int, src: int, nbytes: int, stream: int) -> int:
    ctypes.memmove(dst, src, nbytes)
    return 0


def _no_stream() -> int:
    return 0


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
