"""Batching: without windows, the drain gathers captures into transfers of about a shard.

Without a pattern, while suspended and after the controller's fallback, the drain
copies the oldest ready records that fit. On a thread it takes them only once enough
have piled up, so its Python runs once per transfer, not once per capture. With no
record waiting it parks, and the next capture wakes it
(:meth:`~syncless.capture.drain.DrainWorker.captured`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from syncless.capture.drain.staging import StagingCopier
from syncless.capture.drain.transfers import DrainTransfers
from syncless.capture.ring.records import READY, VOID, WRITTEN, RecordQueue

__all__ = ["DrainBatching"]

# A batching drain with no record waiting sleeps this long at most (the next capture
# wakes it): a bound on a lost wake-up, not a poll.
_PARK_S = 0.1


class DrainBatching:
    """The batching state of one :class:`~syncless.capture.drain.DrainWorker`, and the
    batching steps of its loop (see the module docstring).

    The worker owns it and calls it from its loop, on the drain's thread, with
    ``background`` true when that is a thread of its own; it issues copies through the
    worker's transfers. The capturing thread's :meth:`DrainWorker.captured` counts
    :attr:`held` and reads :attr:`parked`, :attr:`gather_bytes` and :attr:`slots_wake`.
    """

    def __init__(
        self,
        *,
        queue: RecordQueue,
        staging: StagingCopier,
        transfers: DrainTransfers,
        sleep: Callable[[float], None],
        poll_interval_s: float,
        gather_bytes: int,
        gather_s: float,
        batch_bytes: int,
    ) -> None:
        self._queue = queue
        self._staging = staging
        self._transfers = transfers
        self._sleep = sleep  # until woken or the timeout
        self._poll = poll_interval_s
        # Batching gathers captures into one transfer (see _gathered_enough).
        self.gather_bytes = gather_bytes
        # A batching transfer carries about one shard: each becomes one writer's shard,
        # so the writers work in parallel and staging holds several transfers. Taking
        # all of staging at once left the copy engine idle until the writer gave it
        # back: 89% of pinned D2H in 15 transfers of about 1 GiB, against 95% in 30 to
        # 37 before the drain gathered (bench/capture/drain.py, a25e395 and 01755cc).
        self._batch_bytes = batch_bytes
        self._gather_s = gather_s
        # Records in flight that end a gather (and wake the drain): half the slots, so
        # small captures far below gather_bytes do not run out of them first.
        self.slots_wake = queue.max_records // 2
        self._gather_until: float | None = None  # monotonic end of the current gather
        self.parked = False  # no record waits: the next capture wakes the drain
        self.held = 0  # deferred copies captured since the drain last enqueued them

    def batch(self, background: bool) -> bool:
        """Copy the oldest ready records, about a shard, once enough have gathered;
        True if anything moved."""
        transfers = self._transfers
        if self.held:
            self.held = 0
            transfers.mark_landed()  # enqueue the deferred copies, gathered or not
        if transfers.send_oversized_head():
            return True
        if background and not self._gathered_enough():
            return False
        prefix = transfers.ready_prefix(self.limit())
        if not prefix:
            transfers.maybe_kick_writer()
            return False
        self._gather_until = None
        transfers.issue(prefix, "batch")
        return True

    def idle(self, background: bool) -> None:
        """Batching, nothing moved: park while no record waits (the next capture wakes
        the drain); sleep out the gather (:meth:`_gathered_enough`); else wait for the
        copies into the ring of what the next transfer will take."""
        self.parked = True  # before the look: a capture after it sees the flag
        if len(self._queue) <= self._transfers.inflight_records:
            self._gather_until = None
            self._sleep(_PARK_S if background else self._poll)
            self.parked = False
            return
        self.parked = False
        if background and not self._gathered_enough():
            assert self._gather_until is not None
            self._sleep(max(0.0, self._gather_until - time.monotonic()))
            return
        if not self._wait_batch():
            self._sleep(self._gather_s if background else self._poll)

    def limit(self) -> int:
        """Staging bytes the next batching transfer may take: about a shard, or the
        oldest waiting record whole if it is larger."""
        i = self._transfers.inflight_records
        oldest = self._queue.peek(i).span if len(self._queue) > i else 0
        return min(self._staging.largest(), max(self._batch_bytes, oldest))

    def _gathered_enough(self) -> bool:
        """Batching on a thread takes records only once ``gather_bytes`` of them wait
        or the oldest has waited ``gather_s``: captures pile up and go in one
        transfer, so the drain's Python (which holds the GIL) runs per transfer. A
        look per capture cost the training thread 182 us per 4 KiB ``capture()`` on
        the H200 (bench/capture/drain.py, 01755cc); looks every 204 MiB or 20 ms, and
        every 64 deferred captures, still cost a GPU-bound step about 1% (see
        EngineConfig.gather_bytes)."""
        transfers = self._transfers
        if len(self._queue) <= transfers.inflight_records:
            self._gather_until = None  # nothing waits
            return False
        # A record of 0 bytes waits too: it starts the gather timer below (counting bytes
        # alone, the drain once took an empty capture for nothing and died on it).
        # The ring's live bytes less those in flight: no walk over the waiting records,
        # which made a look O(records waiting) and a run of small captures quadratic.
        queue = self._queue
        if queue.ring.live_bytes - transfers.inflight_span >= self.gather_bytes:
            return True
        if len(queue) - transfers.inflight_records >= self.slots_wake:
            return True
        now = time.monotonic()
        if self._gather_until is None:
            self._gather_until = now + self._gather_s
        return now >= self._gather_until

    def _wait_batch(self) -> bool:
        """Batching: wait for the copies into the ring of every record captured so far
        that the next transfer could carry (the newest one's event; releases the GIL),
        so the transfer takes them all at once rather than one per loop. False if
        there is nothing to wait for."""
        self._transfers.mark_landed()
        limit = self.limit()
        total, last = 0, None
        for i in range(self._transfers.inflight_records, len(self._queue)):
            rec = self._queue.peek(i)
            if rec.state not in (WRITTEN, READY, VOID):
                break  # still being enqueued by the training thread
            size = 0 if rec.state == VOID else rec.span
            if total + size > limit:
                break
            total += size
            if rec.state == WRITTEN and rec.landed is not None:
                last = rec
        if last is None or last.landed.query():
            return self._transfers.wait_oldest_record()  # captured on another stream, maybe
        last.landed.synchronize()
        return True
