"""The drain worker: whole records out of the device ring, when and as much as allowed.

One loop, on a thread of its own (or stepped by the caller, ``background=False``):

1. **finish** the transfer in flight once its end stamp is reached: release its
   records' ring space, hand their staged bytes to the writer;
2. **observe** the boundary word: which window is open, which CLOSEs have passed
   (then report the window's transfer to the grant controller), which windows came and
   went unseen;
3. **serve requests** first: ``flush()``/``close()`` (lifecycle) and captures waiting
   on a full ring (capacity, block) drain outside the windows;
4. then, with a pattern (not suspended, no fallback): ask the controller for a grant
   and copy exactly the granted prefix of ready records in the window (planned ahead
   and launched at the OPEN by ``advance_boundary()``, see :meth:`DrainWorker.
   launch_plan`, the default on CUDA; otherwise when the drain sees the OPEN); without
   one (ordinary batching): copy the largest ready prefix that fits in staging.

A transfer is the oldest ready records, whole, packed back to back into the pinned
staging ring by one copy per contiguous run of the device ring (two when the records
wrap around its end) on a dedicated copy stream, between two stamps. One transfer is
in flight at a time. Records larger than the staging ring go one by one into a fresh
host buffer (an *oversized flush*).

The engine measures and reports; the controller decides. For a window transfer the
engine reports, from the device timeline (host clock on CPU): ``before_close`` (the
copy ended before the CLOSE boundary's stamp), ``issued_late`` (the copy started more
than ``late_issue_s`` after the OPEN, or the OPEN's stamp was lost), ``close_late``
(the CLOSE's stamp was lost, e.g. overwritten after ``boundary_pool`` more boundaries:
then ``before_close`` is only the host's observation), ``transfer_s`` and ``window_s``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from syncless.capture.boundary import BoundaryClock, Stamp
from syncless.capture.controller import FlushKind, Grant, GrantController, GrantReason
from syncless.capture.records import READY, VOID, WRITTEN, Record, RecordQueue
from syncless.capture.ring import ByteRing
from syncless.capture.sink import CapturedRecord
from syncless.capture.stats import CaptureStats
from syncless.capture.windows import WindowPattern
from syncless.capture.writer import Batch, SinkWriter
from syncless.cuda_driver import stream_capturing
from syncless.hot_path import hot_path

__all__ = ["DrainWorker", "WindowReport"]

# Transfers in flight at once. Two keep the copy engine busy: the next copy is queued on
# the copy stream while the host finishes the previous one (releases its ring space,
# hands it to the writer), so the host's turnaround does not show up as idle PCIe time.
_MAX_INFLIGHT = 2
# A planned drain with nothing to do sleeps this long at most: whatever gives it
# something to do (a capture, a launch, a request, staging space) wakes it.
_IDLE_WAIT_S = 0.01
# A batching drain with no record waiting sleeps this long at most (the next capture
# wakes it): a bound on a lost wake-up, not a poll.
_PARK_S = 0.1


class WindowReport(NamedTuple):
    """What the engine reported to the controller for one window transfer."""

    occurrence: int
    position: int
    budget: int  # the controller's budget for the window
    granted_bytes: int  # the grant (a whole-record prefix of the ready records)
    granted_records: int
    probe: bool  # the first record alone, larger than the budget
    moved_bytes: int  # bytes the copy moved
    before_close: bool
    issued_late: bool
    close_late: bool
    transfer_s: float | None
    window_s: float | None
    outcome: str


@dataclass(eq=False)
class _Transfer:
    kind: str  # window | batch | flush | oversized: the d2h_<kind>_bytes counter it feeds
    records: list[CapturedRecord]
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


@dataclass(eq=False)
class _Plan:
    """A window copy decided ahead of its OPEN; ``advance_boundary()`` launches it there."""

    version: int
    open_b: int
    close_b: int
    grant: Grant
    records: list[Record]


@dataclass(eq=False)
class _Request:
    kind: str  # lifecycle | capacity | block
    upto: int  # lifecycle, capacity: drain every record up to this sequence number
    need: int  # block: bytes the waiting record needs
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False


class DrainWorker:
    """Moves ready records from the device ring to the writer (see the module docstring)."""

    def __init__(
        self,
        *,
        queue: RecordQueue,
        ring: torch.Tensor,
        staging: torch.Tensor,
        boundary: BoundaryClock,
        controller: GrantController,
        controller_lock: threading.Lock,
        writer: SinkWriter,
        stats: CaptureStats,
        rank: int,
        late_issue_s: float,
        poll_interval_s: float,
        gather_bytes: int,
        gather_s: float,
        batch_bytes: int,
        reports: int = 4096,
        planned: bool = False,
    ) -> None:
        self._queue = queue
        self._ring = ring
        self._staging = staging
        self._staging_ring = ByteRing(staging.numel(), queue.ring.align)
        self._staging_lock = threading.Lock()
        cuda = ring.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(ring.device) if cuda else None
        self._boundary = boundary
        self._timeline = boundary.timeline
        self._ctl = controller
        self._ctl_lock = controller_lock
        self._writer = writer
        self._stats = stats
        self._rank = rank
        self._late_issue_s = late_issue_s
        self._poll = poll_interval_s
        # Batching gathers captures into one transfer (see _gathered_enough).
        self._gather_bytes = gather_bytes
        # A batching transfer carries about one shard: each becomes one writer's shard,
        # so the writers work in parallel and staging holds several transfers. Taking
        # all of staging at once left the copy engine idle until the writer gave it
        # back: 89% of pinned D2H in 15 transfers of about 1 GiB, against 95% in 30 to
        # 37 before the drain gathered (bench/capture_drain.py, a25e395 and 01755cc).
        self._batch_bytes = batch_bytes
        self._gather_s = gather_s
        self._gathered = 0
        self._gather_until: float | None = None  # monotonic end of the current gather
        self._parked = False  # no record waits: the next capture wakes the drain
        self._eager = False  # planned windows: every capture wakes the drain to plan
        self._requests: deque[_Request] = deque()  # served in order, by the drain only
        self._requests_lock = threading.Lock()  # against a request racing the drain's death
        self._inflight: deque[_Transfer] = deque()  # issued, oldest first
        self._inflight_records = 0  # ring records they cover (the oldest in the ring)
        self._awaiting: list[_Transfer] = []  # window transfers done, CLOSE not yet seen
        self._seen = (0, 0)  # latest boundary word: (version, count)
        self._waited: tuple[int, int] | None = None  # the next boundary last slept on
        self._open: tuple[int, int, int, int, int] | None = None  # occ, pos, open, close, ver
        self._handled: tuple[int, int, int] | None = None  # (version, occ, pos) last granted
        self._occurrence = 0
        # Planned windows (CUDA): the next window's copy, decided here and launched by
        # the framework's thread when it publishes the OPEN (launch_plan), and the
        # launched transfers it hands back. Windows are planned in order from the first
        # OPEN not decided yet: (version, boundary).
        self._planned = planned
        self.plan: _Plan | None = None
        self._plan_lock = threading.Lock()
        self._launched: deque[_Transfer] = deque()
        self._plan_from: tuple[int, int] = (-1, 0)
        # No window of the next period granted the ready records: decide again once the
        # stream reaches this (version, count), not at every boundary before it;
        # ``advance_boundary()`` wakes the drain when it publishes count ``wake_at``.
        self._retry_at: tuple[int, int] | None = None
        self.wake_at = -1
        self.reports: deque[WindowReport] = deque(maxlen=reports)
        self.error: BaseException | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="syncless-capture-drain")
        self._thread.daemon = True
        self._thread.start()

    @property
    def background(self) -> bool:
        return self._thread is not None

    @property
    def thread(self) -> threading.Thread | None:
        """The worker thread (None inline or once stopped)."""
        return self._thread

    def stop(self) -> None:
        """Stop the thread (after the caller drained what it wanted) and report every
        window transfer still waiting for its CLOSE as not evidence."""
        self._drop_plan()
        if self._thread is not None:
            self._stopping = True
            self._wake.set()
            self._thread.join()
            self._thread = None
        if self.error is None:
            for t in self._awaiting:
                self._complete(t, forced=True)
        self._awaiting.clear()

    def release_staging(self) -> None:
        """The writer is done with the oldest staged batch (records may wait for it)."""
        with self._staging_lock:
            self._staging_ring.release()
        self._wake.set()

    def staging_used(self) -> int:
        with self._staging_lock:
            return self._staging_ring.live_bytes

    # -- requests from other threads -------------------------------------------------

    def request(self, kind: str, need: int = 0) -> _Request:
        """Drain outside the windows: ``lifecycle`` (everything captured so far, written
        by the sink), ``capacity`` (everything captured so far, out of the ring) or
        ``block`` (until a record of ``need`` bytes fits)."""
        req = _Request(kind, self._queue.last_seq, need)
        with self._requests_lock:
            if self.error is not None:
                req.done.set()  # nobody will serve it: the caller sees drain_error
            else:
                self._requests.append(req)
        self._wake.set()
        return req

    def wait(self, req: _Request) -> None:
        """Wait for ``req``: on the worker, or by stepping the drain here (inline mode)."""
        if self._thread is not None:
            req.done.wait()
            return
        while not req.done.is_set():
            if not self.step():
                self._idle()

    def _idle(self) -> None:
        """Nothing moved this iteration: sleep until something can.

        With a copy in flight, until it lands (the next copy can only start after it on
        the copy stream anyway; a window copy's outcome is judged from device stamps,
        not from when the drain looks). Batching (no windows), see
        :meth:`_idle_batching`; a request, staging space given back, a pattern, suspend
        or resume wake it at once. With windows on the
        device and nothing in flight, until the stream reaches the next boundary:
        windows open and close only there. These waits release the GIL. Polling
        instead, every ``poll_interval_s``, took the GIL thousands of times a second
        from a host-bound training thread. Otherwise (windows on the CPU, a boundary
        the host has not published yet) look again after ``poll_interval_s`` or when
        woken.
        """
        windowed = self._windowed()
        if self._inflight and (self._timeline.blocks or not windowed):
            self._timeline.wait(self._inflight[0].end)
            return
        if not windowed:
            self._idle_batching()
            return
        if self._planned and self._timeline.blocks and self._idle_planned():
            return
        # Once per boundary: a stamp that was only captured in a CUDA graph (or is not
        # recorded yet) returns at once and must not become a spin.
        if self._timeline.blocks and self._waited != self._seen:
            self._waited = self._seen
            stamp = self._boundary.stamp(*self._seen)
            if stamp is not None:
                self._timeline.wait(stamp)
                return
        self._sleep(self._poll)

    def _sleep(self, timeout_s: float) -> None:
        """Until woken (``notify``, a request, staging space) or ``timeout_s``."""
        self._wake.wait(timeout_s)
        # Cleared before the next look at the ring: a wake after this is not lost.
        self._wake.clear()

    def _idle_batching(self) -> None:
        """Batching, nothing moved: park while no record waits (the next capture wakes
        the drain); sleep out the gather (:meth:`_gathered_enough`); else wait for the
        copies into the ring of what the next transfer will take."""
        background = self._thread is not None
        self._parked = True  # before the look: a capture after it sees the flag
        if len(self._queue) <= self._inflight_records:
            self._gather_until = None
            self._sleep(_PARK_S if background else self._poll)
            self._parked = False
            return
        self._parked = False
        if background and not self._gathered_enough():
            assert self._gather_until is not None
            self._sleep(max(0.0, self._gather_until - time.monotonic()))
            return
        if not self._wait_batch():
            self._sleep(self._gather_s if background else self._poll)

    def _batch_limit(self) -> int:
        """Staging bytes the next batching transfer may take: about a shard, or the
        oldest waiting record whole if it is larger."""
        i = self._inflight_records
        oldest = self._queue.peek(i).span if len(self._queue) > i else 0
        return min(self._staging_largest(), max(self._batch_bytes, oldest))

    def _gathered_enough(self) -> bool:
        """Batching on a thread takes records only once ``gather_bytes`` of them wait
        or the oldest has waited ``gather_s``: captures pile up and go in one
        transfer, so the drain's Python (which holds the GIL) runs per transfer. A
        look per capture cost the training thread 182 us per 4 KiB ``capture()`` on
        the H200 (bench/capture_drain.py, 01755cc)."""
        self._gathered = 0  # wake again after that many more bytes
        waiting = 0
        for i in range(self._inflight_records, len(self._queue)):
            waiting += self._queue.peek(i).span
            if waiting >= self._gather_bytes:
                return True
        if not waiting:
            self._gather_until = None
            return False
        now = time.monotonic()
        if self._gather_until is None:
            self._gather_until = now + self._gather_s
        return now >= self._gather_until

    def _wait_batch(self) -> bool:
        """Batching: wait for the copies into the ring of every record captured so far
        that the next transfer could carry (the newest one's event; releases the GIL),
        so the transfer takes them all at once rather than one per loop. False if
        there is nothing to wait for."""
        limit = self._batch_limit()
        total, last = 0, None
        for i in range(self._inflight_records, len(self._queue)):
            rec = self._queue.peek(i)
            if rec.state not in (WRITTEN, READY, VOID):
                break  # still being enqueued by the training thread
            size = 0 if rec.state == VOID else rec.span
            if total + size > limit:
                break
            total += size
            if rec.state == WRITTEN and rec.event is not None:
                last = rec
        if last is None or last.event.query():
            return self._wait_oldest_record()  # captured on another stream, maybe
        last.event.synchronize()
        return True

    def _wait_oldest_record(self) -> bool:
        """Wait for the oldest record not in flight if its copy into the ring has not
        landed yet (its event releases the GIL); False if there is none to wait for."""
        i = self._inflight_records
        if len(self._queue) <= i:
            return False
        rec = self._queue.peek(i)
        if rec.state == WRITTEN and rec.event is not None and not rec.event.query():
            rec.event.synchronize()
            return True
        return False

    def _idle_planned(self) -> bool:
        """Planned windows, nothing in flight: sleep until the next thing that can change
        what to do, once each (a window copy's CLOSE, the oldest record's copy into the
        ring, a launch or a capture, which wake the drain); False to wait for the next
        boundary instead (ready records that no window of the next period granted)."""
        if self._awaiting:
            t = self._awaiting[0]
            stamp = self._boundary.stamp(t.version, t.close_b)
            key = ("close", t.version, t.close_b)
            if stamp is not None and self._waited != key:
                self._waited = key
                self._timeline.wait(stamp)
                return True
        if self.plan is None:
            if self._wait_oldest_record():
                return True
            i = self._inflight_records
            ready = len(self._queue) > i and self._ready(self._queue.peek(i))
            if ready and self._retry_at is None:
                return False
        self._sleep(_IDLE_WAIT_S)
        return True

    def notify(self) -> None:
        """Something changed that an idle drain must see now: wake it."""
        self._wake.set()

    @hot_path
    def captured(self, span: int) -> None:
        """A record of ``span`` ring bytes was captured: wake the drain if enough piled
        up (or always, for planned windows, which plan as soon as records are ready).
        The unlocked count may lose an update to a race with the drain's reset; that
        only delays the wake until the drain's next look, ``gather_s`` at most."""
        self._gathered += span
        if self._eager or self._parked or self._gathered >= self._gather_bytes:
            self._wake.set()

    # -- planned windows: the framework's thread launches at the OPEN -------------------

    @hot_path
    def launch_plan(self, version: int, boundary: int) -> None:
        """``advance_boundary()`` published ``boundary``: if the planned copy waits for
        it, launch it now, on the copy stream behind the boundary's stamp.

        Why the framework's thread: it is there when the OPEN is published, while a
        drain thread that reacts to the OPEN needs the GIL first, and a host-bound
        training thread keeps it for up to the 5 ms switch interval, longer than most
        windows. The launch is one stream wait, two stamps and a copy per contiguous
        run of records (a few per captured record, tens of microseconds); every other
        decision was made by the drain beforehand. The copy stream waits on an event
        already recorded, so nothing is held for a boundary not yet published (a copy
        held for a future boundary would stall ``torch.cuda.synchronize()`` until it).
        """
        plan = self.plan
        if plan is None or plan.open_b != boundary or plan.version != version:
            return
        if self._copy_stream is not None and stream_capturing():  # (a CPU build's raises)
            return  # a graph would replay the copy: the drain drops the plan
        # Held through the launch: torch ops release the GIL, and a drain that ran in
        # between would see neither the plan nor its transfer and plan the same records
        # again.
        with self._plan_lock:
            if self.plan is not plan:
                return
            self.plan = None
            t = self._copy(plan.records, "window", self._boundary.stamp(version, boundary))
            if t is not None:
                t.grant = plan.grant
                t.version, t.open_b, t.close_b = version, plan.open_b, plan.close_b
                self._launched.append(t)
        self._stats.add("window_launched_count" if t is not None else "window_plan_dropped_count")
        self._wake.set()

    def _absorb_launched(self) -> None:
        """Take the transfers launch_plan() made into this thread's bookkeeping."""
        with self._plan_lock:
            while self._launched:
                t = self._launched.popleft()
                self._inflight.append(t)
                self._inflight_records += t.count

    def _drop_plan(self) -> None:
        """No plan from here on; a launch that took it first is absorbed."""
        with self._plan_lock:
            dropped, self.plan = self.plan, None
        if dropped is not None:
            self._stats.add("window_plan_dropped_count")
        self._absorb_launched()

    def _plan_window(self) -> bool:
        """Decide the copy of the next window whose OPEN is not published yet.

        Windows are decided in order; one whose grant is empty (cooling down, too
        short) is passed over for the next, at most one period ahead. One window copy
        at a time: planned, launched or in flight."""
        plan = self.plan
        if plan is not None:
            published = self._boundary.published
            if self._boundary.version == plan.version and published <= plan.open_b + 1:
                return False  # its OPEN is still to come (or being launched right now)
            self._drop_plan()  # its OPEN passed unlaunched (graph capture, a new pattern)
        self._absorb_launched()  # under the lock: a launch finished, or none is under way
        if self._inflight:
            return False
        retry = self._retry_at
        if retry is not None:
            if retry[0] == self._boundary.version and self._boundary.published < retry[1]:
                return False  # the windows up to there granted nothing: not yet
            self._retry_at, self.wake_at = None, -1
        prefix = self._ready_prefix(self._staging_largest())
        if not prefix:
            return False
        with self._ctl_lock:
            pattern, version = self._ctl.pattern, self._ctl.version
        if pattern is None or self._boundary.version != version:
            return False
        first = self._boundary.published
        if self._plan_from[0] == version:
            first = max(first, self._plan_from[1])
        for occurrence, position, open_b, close_b in _windows_from(pattern, first):
            self._plan_from = (version, open_b + 1)
            last_s = self._last_duration(version, open_b, close_b, pattern.period)
            with self._ctl_lock:
                grant = self._ctl.grant(position, occurrence, (r.span for r in prefix), last_s)
            self._stats.add("window_grants_count")
            if grant.reason in (GrantReason.SUSPENDED, GrantReason.FALLBACK):
                return False  # no windows any more: the batching path takes over
            if grant.records:
                self.plan = _Plan(version, open_b, close_b, grant, prefix[: grant.records])
                self._stats.add("window_planned_count")
                return True
        # A period of windows granted nothing: look again when the last of them opens.
        self._retry_at = self._plan_from
        self.wake_at = self._plan_from[1]
        return False

    # -- the loop ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._stats.add("drain_loops_count")
                if not self.step():
                    self._idle()
        except BaseException as e:
            self._die(e)

    def _die(self, err: BaseException) -> None:
        self.plan = None  # nothing is launched for a dead drain
        with self._requests_lock:
            self.error = err
            self._queue.fail()
            while self._requests:
                self._requests.popleft().done.set()
        print(
            f"syncless: capture drain worker failed ({err!r}); new captures are dropped "
            f"(drain_error) and records left in the ring are counted as dropped at close()",
            file=sys.stderr,
        )

    def step(self) -> bool:
        """One iteration; True if anything moved."""
        self._absorb_launched()
        progressed = self._finish()
        self._observe()
        progressed |= self._serve_requests()
        windowed = self._windowed()
        self._eager = self._planned and windowed
        if not self._requests and len(self._inflight) < _MAX_INFLIGHT:
            if windowed:
                progressed |= self._serve_window()
            else:
                if self._planned:
                    self._drop_plan()  # suspended or fallen back: batching takes them
                progressed |= self._batch()
        self._writer.poll()
        return progressed

    def _windowed(self) -> bool:
        with self._ctl_lock:
            ctl = self._ctl
            return ctl.pattern is not None and not ctl.suspended and not ctl.fallback

    # -- 1. finish ----------------------------------------------------------------------

    def _finish(self) -> bool:
        progressed = False
        while self._inflight and self._timeline.done(self._inflight[0].end):
            self._finish_one(self._inflight.popleft())
            progressed = True
        return progressed

    def _finish_one(self, t: _Transfer) -> None:
        self._inflight_records -= t.count
        if t.count:
            self._queue.release(t.count)
        elapsed = self._timeline.elapsed_s(t.start, t.end)
        self._stats.add2("d2h_count", 1, "d2h_bytes", t.moved)
        self._stats.add2(f"d2h_{t.kind}_bytes", t.moved, "d2h_ms", (elapsed or 0.0) * 1e3)
        if t.records or t.staged:
            self._writer.submit(Batch(t.records, t.data_bytes, t.staged))
        if t.grant is not None:
            version, count = self._boundary.read()
            t.seen_done_at = count if version == t.version else t.close_b + 1
            self._awaiting.append(t)

    # -- 2. observe ---------------------------------------------------------------------

    def _observe(self) -> None:
        version, count = self._boundary.read()
        with self._ctl_lock:
            pattern = self._ctl.pattern
            current = self._ctl.version
            windowed = pattern is not None and not self._ctl.suspended and not self._ctl.fallback
        if self._awaiting:
            keep = []
            for t in self._awaiting:
                if windowed and t.version == version and count <= t.close_b:
                    keep.append(t)  # its CLOSE has not been reached yet
                else:
                    # CLOSE reached, or the window was cut short (suspend, fallback, new
                    # pattern): the controller decides what the completion is worth.
                    self._complete(t, forced=not (t.version == version and count > t.close_b))
            self._awaiting = keep

        prev = self._seen[1] if self._seen[0] == version else 0
        self._seen = (version, count)
        if not windowed or version != current or pattern is None:
            self._open = None
            return
        if self._planned:  # planned windows: decided ahead, never missed
            if count:
                self._occurrence = pattern.locate(count - 1)[0]
            return
        if count == prev or count == 0:
            return
        last = count - 1
        occurrence, position = pattern.locate(last)
        self._occurrence = occurrence
        key = None if position is None else (occurrence, position)
        missed = 0
        if self._open is not None and self._open[:2] != key:
            missed += 1  # it was open at the last look and has closed since, unserved
            self._open = None
        opened = _opens_upto(pattern, last) - _opens_upto(pattern, prev - 1)
        if opened and key is not None:
            begin, end = pattern.bounds(*key)
            if begin > prev - 1 and self._handled != (version, *key):
                missed += opened - 1
                self._open = (*key, begin, end, version)
            else:
                missed += opened
        else:
            missed += opened
        if missed:
            self._stats.add("window_missed_count", missed)

    # -- 3. requests ----------------------------------------------------------------------

    def _serve_requests(self) -> bool:
        if not self._requests:
            return False
        if self._planned:
            self._drop_plan()  # a planned copy would take records the request drains now
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
                    self._ctl.flush(kind, self._occurrence)
        if self._request_done(req):
            if req.kind == "lifecycle":
                self._writer.flush()
            self._requests.popleft()
            req.done.set()
            return True
        if len(self._inflight) >= _MAX_INFLIGHT:
            return False
        if self._send_oversized_head():
            return True
        if req.kind == "block" and self._windowed():
            prefix = self._ready_prefix(self._staging_largest(), stop_after=req.need)
        else:
            upto = None if req.kind == "block" else req.upto
            prefix = self._ready_prefix(self._staging_largest(), upto=upto)
        if not prefix:
            self._maybe_kick_writer()
            return False
        self._issue(prefix, "flush")
        return True

    def _request_done(self, req: _Request) -> bool:
        if self._queue.failed:
            return True
        if req.kind == "block":
            return self._queue.closed or self._queue.can_fit(req.need)
        return len(self._queue) == 0 or self._queue.peek(0).seq > req.upto

    # -- 4. windows, or ordinary batching --------------------------------------------------

    def _serve_window(self) -> bool:
        if self._planned:
            return self._plan_window()
        if self._open is None:
            return False
        occurrence, position, open_b, close_b, version = self._open
        self._open = None
        self._handled = (version, occurrence, position)
        # The simulator's order: a record too large for staging goes by an oversized
        # flush (never granted), then the window gets its grant.
        while self._send_oversized_head():
            with self._ctl_lock:
                self._ctl.flush(FlushKind.OVERSIZED, occurrence)
        prefix = self._ready_prefix(self._staging_largest())
        with self._ctl_lock:
            pattern = self._ctl.pattern
            period = pattern.period if pattern is not None else 0
            last_s = self._last_duration(version, open_b, close_b, period) if prefix else None
            grant = self._ctl.grant(position, occurrence, (r.span for r in prefix), last_s)
        self._stats.add("window_grants_count")
        if grant.records == 0:
            return True
        self._issue(
            prefix[: grant.records],
            "window",
            grant=grant,
            window=(version, open_b, close_b),
        )
        return True

    def _last_duration(self, version: int, open_b: int, close_b: int, period: int) -> float | None:
        """This window's duration in the previous occurrence, from its boundary stamps
        (None when they are gone or it had none)."""
        if period <= 0 or open_b < period:
            return None
        boundary = self._boundary
        start = boundary.stamp(version, open_b - period)
        end = boundary.stamp(version, close_b - period)
        if start is None or end is None:
            return None
        seconds = self._timeline.elapsed_s(start, end)
        if seconds is None or seconds < 0:
            return None
        if not (
            boundary.still_owned(version, open_b - period)
            and boundary.still_owned(version, close_b - period)
        ):
            return None  # a slot reused while it was read
        return seconds

    def _batch(self) -> bool:
        if self._send_oversized_head():
            return True
        if self._thread is not None and not self._gathered_enough():
            return False
        prefix = self._ready_prefix(self._batch_limit())
        if not prefix:
            self._maybe_kick_writer()
            return False
        self._gather_until = None
        self._issue(prefix, "batch")
        return True

    # -- records and copies ---------------------------------------------------------------

    def _ready(self, rec: Record) -> bool:
        state = rec.state
        if state in (READY, VOID):
            return True
        if state == WRITTEN and (rec.event is None or rec.event.query()):
            rec.state = READY
            return True
        return False  # still RESERVED: its copy is being enqueued right now

    def _ready_prefix(
        self, limit: int, upto: int | None = None, stop_after: int | None = None
    ) -> list[Record]:
        """The oldest ready records whose copies fit in ``limit`` staging bytes, none
        larger than the staging ring; up to sequence number ``upto``, or just enough to
        free ``stop_after`` bytes."""
        out: list[Record] = []
        total = freed = 0
        capacity = self._staging_ring.capacity
        for i in range(self._inflight_records, len(self._queue)):
            rec = self._queue.peek(i)
            if not self._ready(rec) or (upto is not None and rec.seq > upto):
                break
            size = 0 if rec.state == VOID else rec.span
            if size > capacity or total + size > limit:
                break
            out.append(rec)
            total += size
            freed += rec.span
            if stop_after is not None and freed >= stop_after:
                break
        return out

    def _staging_largest(self) -> int:
        with self._staging_lock:
            return self._staging_ring.largest()

    def _maybe_kick_writer(self) -> None:
        """Ready records wait for staging space held by the writer: have it write now."""
        i = self._inflight_records
        if len(self._queue) > i:
            rec = self._queue.peek(i)
            fits_staging = rec.span <= self._staging_ring.capacity
            if fits_staging and self._ready(rec) and rec.span > self._staging_largest():
                self._writer.kick()

    def _copy_context(self) -> contextlib.AbstractContextManager[Any]:
        if self._copy_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._copy_stream)

    def _issue(
        self,
        records: list[Record],
        kind: str,
        grant: Grant | None = None,
        window: tuple[int, int, int] | None = None,
    ) -> None:
        """Copy ``records`` (the oldest ready ones) into staging, back to back."""
        t = self._copy(records, kind)
        if t is None:
            raise RuntimeError(f"staging has no room for {kind} records (a drain bug)")
        if grant is not None and window is not None:
            t.grant = grant
            t.version, t.open_b, t.close_b = window
        self._inflight.append(t)
        self._inflight_records += t.count
        self._finish()  # on CPU the copy has landed already

    @hot_path
    def _copy(
        self, records: list[Record], kind: str, after: Stamp | None = None
    ) -> _Transfer | None:
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
        with self._copy_context():
            if after is not None and self._copy_stream is not None:
                self._copy_stream.wait_event(after)
            start = self._timeline.stamp(self._copy_stream)
            for dev, pos, length in runs:
                if length:
                    self._staging[pos : pos + length].copy_(
                        self._ring[dev : dev + length], non_blocking=True
                    )
            end = self._timeline.stamp(self._copy_stream)
        out = [
            CapturedRecord(
                r.seq,
                r.tag,
                r.step,
                self._rank,
                r.shape,
                r.dtype,
                r.nbytes,
                r.meta,
                self._staging[p : p + r.nbytes],
            )
            for r, p in zip(live, positions, strict=True)
        ]
        return _Transfer(
            kind, out, len(records), moved, sum(r.nbytes for r in live), moved > 0, start, end
        )

    def _send_oversized_head(self) -> bool:
        """Send the oldest record alone through a fresh host buffer if it is ready and
        larger than the staging ring. Only when nothing else is in flight (ring order)."""
        if self._inflight or not len(self._queue):
            return False
        rec = self._queue.peek(0)
        if rec.span <= self._staging_ring.capacity or not self._ready(rec):
            return False
        if rec.state == VOID:
            self._queue.release(1)
            return True
        # Pageable, allocated here and freed by the writer: pinning a one-off buffer
        # costs more than the copy it would speed up. non_blocking keeps torch's sync
        # debug mode (process-wide under no_sync()) from flagging this thread's copy; the
        # wait is the event's.
        host = torch.empty(rec.nbytes, dtype=torch.uint8)
        with self._copy_context():
            start = self._timeline.stamp(self._copy_stream)
            host.copy_(self._ring[rec.offset : rec.offset + rec.nbytes], non_blocking=True)
            end = self._timeline.stamp(self._copy_stream)
        self._timeline.wait(end)
        record = CapturedRecord(
            rec.seq, rec.tag, rec.step, self._rank, rec.shape, rec.dtype, rec.nbytes, rec.meta, host
        )
        self._stats.add("flush_oversized_count")
        self._inflight.append(
            _Transfer("oversized", [record], 1, rec.span, rec.nbytes, False, start, end)
        )
        self._inflight_records += 1
        self._finish()
        return True

    # -- window completions -----------------------------------------------------------------

    def _complete(self, t: _Transfer, forced: bool) -> None:
        """Report a window transfer to the controller, measured as well as it can be."""
        boundary, timeline, grant = self._boundary, self._timeline, t.grant
        assert grant is not None
        open_stamp = boundary.stamp(t.version, t.open_b)
        issued_late = True
        window_s = None
        if open_stamp is not None:
            delay = timeline.elapsed_s(open_stamp, t.start)
            if delay is not None and boundary.still_owned(t.version, t.open_b):
                # Started before its OPEN (a stamp reused meanwhile): no evidence either.
                issued_late = delay > self._late_issue_s or delay < 0
        transfer_s = timeline.elapsed_s(t.start, t.end)
        # Host observation, used only when the CLOSE's stamp is lost (then close_late).
        before_close = t.seen_done_at <= t.close_b
        close_late = True
        close_stamp = None if forced else boundary.stamp(t.version, t.close_b)
        if close_stamp is not None:
            margin = timeline.elapsed_s(t.end, close_stamp)
            window = None if open_stamp is None else timeline.elapsed_s(open_stamp, close_stamp)
            if margin is not None and boundary.still_owned(t.version, t.close_b):
                close_late = False
                before_close = margin > 0  # ending exactly at the CLOSE is an overrun
                if window is not None and boundary.still_owned(t.version, t.open_b):
                    window_s = window
        if transfer_s is not None and transfer_s < 0:
            transfer_s = None
        if window_s is not None and window_s < 0:
            window_s = None
        with self._ctl_lock:
            outcome = self._ctl.complete(
                grant,
                before_close=before_close,
                issued_late=issued_late,
                close_late=close_late,
                transfer_s=transfer_s,
                window_s=window_s,
            )
        stats = self._stats
        stats.add("window_transfers_count")
        stats.add("window_overruns_count", int(not before_close))
        stats.add("window_issued_late_count", int(issued_late))
        stats.add("window_close_late_count", int(close_late))
        self.reports.append(
            WindowReport(
                grant.occurrence,
                grant.position,
                grant.budget,
                grant.nbytes,
                grant.records,
                grant.probe,
                t.moved,
                before_close,
                issued_late,
                close_late,
                transfer_s,
                window_s,
                outcome.value,
            )
        )


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


def _windows_from(pattern: WindowPattern, first: int) -> list[tuple[int, int, int, int]]:
    """The windows whose OPEN boundary is ``first`` or later, one period's worth:
    ``(occurrence, position, open boundary, close boundary)``, in order."""
    occurrence, phase = divmod(first, pattern.period)
    out = []
    for occ in (occurrence, occurrence + 1):
        base = occ * pattern.period
        for position, (begin, end) in enumerate(pattern.windows):
            if occ > occurrence or begin >= phase:
                out.append((occ, position, base + begin, base + end))
    return out[: len(pattern.windows)]


def _opens_upto(pattern: WindowPattern, boundary: int) -> int:
    """How many window OPENs fall on boundaries ``0 .. boundary`` (0 if negative)."""
    if boundary < 0:
        return 0
    occurrence, phase = divmod(boundary, pattern.period)
    begins = [b for b, _ in pattern.windows]
    return occurrence * len(begins) + bisect_right(begins, phase)
