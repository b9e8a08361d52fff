"""Small captures coalesced into one copy launch: ``capture(..., coalesce=True)``.

A capture's floor on the host is the stream operation that copies it into the ring:
7.1-8.3 us of the H200 host per ``cuMemcpyDtoDAsync``, and no cheaper launch was found
(bench/driver_calls.py, copy_probe; docs/capture.md). A coalesced capture enqueues
nothing. It keeps a reference to the tensor and its version counter; at the next flush
point one ``torch._foreach_copy_`` per stream copies every waiting tensor into its
ring slot, and the slots get their landing event as batched captures do.

The bytes stored are the tensor's at the flush point, not at the ``capture()`` call.
A tensor whose version counter moved in between (an in-place op, an ``out=`` write, a
write through a view) is dropped and counted (``modified``), never stored with the
later bytes. Writes that bypass the counter (``.data``, a collective into the tensor, a
custom kernel through its pointer) are not seen: coalesce tensors nothing writes
before the flush point, such as a forward hook's outputs. Tensors created under
``torch.inference_mode()`` have no version counter and are copied at once.

Flush points: ``EngineConfig.coalesce_count`` waiting captures or
``coalesce_bytes`` of them (the capture that reaches either pays for the launch), and
the engine's ``report()``, ``flush()``, ``close()`` and ``advance_boundary()``. Until
then the waiting tensors stay allocated: ``coalesce_bytes`` bounds that memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from syncless.capture.records import VOID, WRITTEN, Record
from syncless.capture.stats import CaptureStats, DropReason
from syncless.hot_path import hot_path

if TYPE_CHECKING:
    from syncless.capture.drain import DrainWorker
    from syncless.capture.ring_copy import RingCopier

__all__ = ["Coalescer", "Waiting", "coalescible", "copy_waiting"]


class Waiting(NamedTuple):
    """A capture waiting for the next flush point."""

    tag: str
    step: int | None
    tensor: torch.Tensor
    version: int  # tensor._version at capture()
    nbytes: int
    meta: str | None
    policy: Any  # the capture's OnFull
    stream: int  # the raw CUstream current at capture() (0 on the CPU)


class Coalescer:
    """Captures waiting for one copy launch, in capture order; thresholds say when."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self._max_count = max_count
        self._max_bytes = max_bytes
        self._waiting: list[Waiting] = []
        self._bytes = 0
        self._lock = threading.Lock()  # threads may capture at once

    def __len__(self) -> int:
        return len(self._waiting)

    @hot_path
    def add(self, item: Waiting) -> bool:
        """Hold ``item``; True once the waiting captures reach a threshold."""
        with self._lock:
            self._waiting.append(item)
            self._bytes += item.nbytes
            return len(self._waiting) >= self._max_count or self._bytes >= self._max_bytes

    @hot_path
    def take(self) -> dict[int, list[Waiting]]:
        """Every waiting capture, by stream in capture order; none wait afterwards."""
        with self._lock:
            items, self._waiting, self._bytes = self._waiting, [], 0
        groups: dict[int, list[Waiting]] = {}
        for item in items:
            groups.setdefault(item.stream, []).append(item)
        return groups


@hot_path
def coalescible(tensor: torch.Tensor) -> bool:
    """Has a version counter to check at the flush point (inference tensors do not)."""
    return not tensor.is_inference()


@hot_path
def copy_waiting(
    coalescer: Coalescer,
    reserve: Callable[..., Record | None],
    copier: RingCopier,
    drain: DrainWorker,
    stats: CaptureStats,
) -> None:
    """The flush point: every waiting capture still unchanged gets its ring slot
    (``reserve``: the engine's, which counts drops for lack of room) and one copy
    launch per stream; a changed one is dropped (``modified``)."""
    for stream, group in coalescer.take().items():
        recs, tensors = [], []
        for item in group:
            if item.tensor._version != item.version:
                stats.drop(DropReason.MODIFIED, item.nbytes)
                continue
            rec = reserve(item.tag, item.step, item.tensor, item.nbytes, item.meta, item.policy)
            if rec is not None:
                recs.append(rec)
                tensors.append(item.tensor)
        if not recs:
            continue
        nbytes = sum(rec.nbytes for rec in recs)
        try:
            copier.copy_many(recs, tensors, stream, drain.defer_landing)
        except BaseException:
            for rec in recs:
                rec.state = VOID  # released in order, its bytes ignored
            stats.drop(DropReason.COPY_ERROR, nbytes, len(recs))
            raise
        for rec in recs:
            rec.state = WRITTEN
            drain.captured(rec.span)
        stats.captured(len(recs), nbytes)
