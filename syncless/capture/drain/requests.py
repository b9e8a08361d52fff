"""Drains outside the windows that other threads ask for: ``flush()`` and ``close()``
(lifecycle), and captures waiting on a full ring (capacity, block).

Any thread submits a :class:`Request` and waits on its ``done`` event; the drain's loop
serves them first, in order (:mod:`syncless.capture.drain.worker`, step 3).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from syncless.capture.controller import FlushKind, GrantController
from syncless.capture.drain.batching import DrainBatching
from syncless.capture.drain.staging import StagingCopier
from syncless.capture.drain.transfers import DrainTransfers
from syncless.capture.drain.windows import DrainWindows
from syncless.capture.ring.records import RecordQueue
from syncless.capture.stats import CaptureStats
from syncless.capture.writer import SinkWriter

__all__ = ["MAX_INFLIGHT", "DrainRequests", "Request"]

# Transfers in flight at once. Two keep the copy engine busy: the next copy is queued on
# the copy stream while the host finishes the previous one (releases its ring space,
# hands it to the writer), so the host's turnaround does not show up as idle PCIe time.
MAX_INFLIGHT = 2


@dataclass(eq=False)
class Request:
    """A drain outside the windows that another thread asked for (:meth:`DrainRequests.submit`)."""

    kind: str  # lifecycle | capacity | block
    upto: int  # lifecycle, capacity: drain every record up to this sequence number
    need: int  # block: bytes the waiting record needs
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False


class DrainRequests:
    """The requests waiting for one :class:`~syncless.capture.drain.DrainWorker`, and
    how its loop serves them.

    Any thread calls :meth:`submit`; the drain's thread calls :meth:`serve` and, when
    it dies, :meth:`fail`. The requests are served through the worker's transfers,
    with its windows, batching, staging, writer and controller.
    """

    def __init__(
        self,
        *,
        queue: RecordQueue,
        transfers: DrainTransfers,
        windows: DrainWindows,
        batching: DrainBatching,
        staging: StagingCopier,
        writer: SinkWriter,
        stats: CaptureStats,
        controller: GrantController,
        controller_lock: threading.Lock,
        planned: bool,
    ) -> None:
        self._queue = queue
        self._transfers = transfers
        self._windows = windows
        self._batching = batching
        self._staging = staging
        self._writer = writer
        self._stats = stats
        self._ctl = controller
        self._ctl_lock = controller_lock
        self._planned = planned
        self._waiting: deque[Request] = deque()  # served in order, by the drain only
        self._lock = threading.Lock()  # against a request racing the drain's death
        self._failed = False  # the drain died: nobody serves requests any more

    def __len__(self) -> int:
        """Requests waiting (served or not yet started)."""
        return len(self._waiting)

    # -- any thread -----------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue ``req`` for the drain; done at once if the drain has died."""
        with self._lock:
            if self._failed:
                req.done.set()  # nobody will serve it: the caller sees drain_error
            else:
                self._waiting.append(req)

    # -- the drain's thread ---------------------------------------------------------

    def fail(self) -> None:
        """The drain died: every waiting request is done, and so is every later one."""
        with self._lock:
            self._failed = True
            while self._waiting:
                self._waiting.popleft().done.set()

    def serve(self) -> bool:
        """Work on the oldest request (step 3 of the drain's loop); True if anything moved."""
        if not self._waiting:
            return False
        if self._planned:
            self._windows.drop_plan()  # a planned copy would take records the request drains now
        req = self._waiting[0]
        if not req.started:
            req.started = True
            if req.kind == "block" and self._queue.can_fit(req.need):
                self._waiting.popleft()
                req.done.set()
                return True
            self._stats.add(f"flush_{'lifecycle' if req.kind == 'lifecycle' else 'capacity'}_count")
            kind = FlushKind.LIFECYCLE if req.kind == "lifecycle" else FlushKind.CAPACITY
            with self._ctl_lock:
                if self._ctl.pattern is not None:
                    self._ctl.flush(kind, self._windows.occurrence)
        if self._done(req):
            if req.kind == "lifecycle":
                self._writer.flush()
            self._waiting.popleft()
            req.done.set()
            return True
        transfers = self._transfers
        if len(transfers.inflight) >= MAX_INFLIGHT:
            return False
        if transfers.send_oversized_head():
            return True
        if req.kind == "block" and self._windows.active():
            prefix = transfers.ready_prefix(self._staging.largest(), stop_after=req.need)
        else:
            # Batching, a flush goes in shard-sized transfers too: a capture blocked on a
            # full ring otherwise had the drain take all of staging at once, one shard
            # for one writer (4 writers stored 3.35 GB/s where the disk took 11.8 from
            # four threads; bench/capture/load.py, 9fc45db).
            upto = None if req.kind == "block" else req.upto
            windowed = self._windows.active()
            limit = self._staging.largest() if windowed else self._batching.limit()
            prefix = transfers.ready_prefix(limit, upto=upto)
        if not prefix:
            transfers.maybe_kick_writer()
            return False
        transfers.issue(prefix, "flush")
        return True

    def _done(self, req: Request) -> bool:
        if self._queue.failed:
            return True
        if req.kind == "block":
            return self._queue.closed or self._queue.can_fit(req.need)
        return len(self._queue) == 0 or self._queue.peek(0).seq > req.upto
