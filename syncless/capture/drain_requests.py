"""Drains outside the windows that other threads ask for: ``flush()`` and ``close()``
(lifecycle), and captures waiting on a full ring (capacity, block). Served first, in
order, by the drain's loop (:mod:`syncless.capture.drain`, step 3)."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from syncless.capture.controller import FlushKind

if TYPE_CHECKING:
    from syncless.capture.controller import GrantController
    from syncless.capture.drain_batching import DrainBatching
    from syncless.capture.drain_transfers import DrainTransfers
    from syncless.capture.drain_windows import DrainWindows
    from syncless.capture.records import RecordQueue
    from syncless.capture.staging_copy import StagingCopier
    from syncless.capture.stats import CaptureStats
    from syncless.capture.writer import SinkWriter

__all__ = ["MAX_INFLIGHT", "DrainRequests", "Request"]

# Transfers in flight at once. Two keep the copy engine busy: the next copy is queued on
# the copy stream while the host finishes the previous one (releases its ring space,
# hands it to the writer), so the host's turnaround does not show up as idle PCIe time.
MAX_INFLIGHT = 2


@dataclass(eq=False)
class Request:
    """A drain outside the windows that another thread asked for (:meth:`DrainRequests.request`)."""

    kind: str  # lifecycle | capacity | block
    upto: int  # lifecycle, capacity: drain every record up to this sequence number
    need: int  # block: bytes the waiting record needs
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False


class DrainRequests:
    """``request``, ``wait`` and serving requests, for
    :class:`~syncless.capture.drain.DrainWorker`.

    A mixin: the attributes below, ``step``, ``_idle`` and ``_windowed`` come from
    ``DrainWorker``.
    """

    error: BaseException | None
    _queue: RecordQueue
    _requests: deque[Request]
    _requests_lock: threading.Lock
    _wake: threading.Event
    _thread: threading.Thread | None
    _planned: bool
    _windows: DrainWindows
    _stats: CaptureStats
    _ctl: GrantController
    _ctl_lock: threading.Lock
    _writer: SinkWriter
    _transfers: DrainTransfers
    _staging: StagingCopier
    _batching: DrainBatching

    # -- requests from other threads -------------------------------------------------

    def request(self, kind: str, need: int = 0) -> Request:
        """Drain outside the windows: ``lifecycle`` (everything captured so far, written
        by the sink), ``capacity`` (everything captured so far, out of the ring) or
        ``block`` (until a record of ``need`` bytes fits)."""
        req = Request(kind, self._queue.last_seq, need)
        with self._requests_lock:
            if self.error is not None:
                req.done.set()  # nobody will serve it: the caller sees drain_error
            else:
                self._requests.append(req)
        self._wake.set()
        return req

    def wait(self, req: Request) -> None:
        """Wait for ``req``: on the worker, or by stepping the drain here (inline mode)."""
        if self._thread is not None:
            req.done.wait()
            return
        while not req.done.is_set():
            if not self.step():
                self._idle()

    # -- 3. requests ----------------------------------------------------------------------

    def _serve_requests(self) -> bool:
        if not self._requests:
            return False
        if self._planned:
            self._windows.drop_plan()  # a planned copy would take records the request drains now
        req = self._requests[0]
        if not req.started:
            req.started = True
            if req.kind == "block" and self._queue.can_fit(req.need):
                self._requests.popleft()
                req.done.set()
                return True
            self._stats.add(f"flush_{'lifecycle' if req.kind == 'lifecycle' else 'capacity'}_count")
            kind = FlushKind.LIFECYCLE if req.kind == "lifecycle" else FlushKind.CAPACITY
            with self._ctl_lock:
                if self._ctl.pattern is not None:
                    self._ctl.flush(kind, self._windows.occurrence)
        if self._request_done(req):
            if req.kind == "lifecycle":
                self._writer.flush()
            self._requests.popleft()
            req.done.set()
            return True
        transfers = self._transfers
        if len(transfers.inflight) >= MAX_INFLIGHT:
            return False
        if transfers.send_oversized_head():
            return True
        if req.kind == "block" and self._windowed():
            prefix = transfers.ready_prefix(self._staging.largest(), stop_after=req.need)
        else:
            # Batching, a flush goes in shard-sized transfers too: a capture blocked on a
            # full ring otherwise had the drain take all of staging at once, one shard
            # for one writer (4 writers stored 3.35 GB/s where the disk took 11.8 from
            # four threads; bench/capture_load.py, 9fc45db).
            upto = None if req.kind == "block" else req.upto
            windowed = self._windowed()
            limit = self._staging.largest() if windowed else self._batching.limit()
            prefix = transfers.ready_prefix(limit, upto=upto)
        if not prefix:
            transfers.maybe_kick_writer()
            return False
        transfers.issue(prefix, "flush")
        return True

    def _request_done(self, req: Request) -> bool:
        if self._queue.failed:
            return True
        if req.kind == "block":
            return self._queue.closed or self._queue.can_fit(req.need)
        return len(self._queue) == 0 or self._queue.peek(0).seq > req.upto
