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

The worker runs the loop, its thread and its wake-ups. The objects it owns hold the
rest, each with its own state: the transfers in flight
(:mod:`syncless.capture.drain.transfers`) and their copies into the pinned staging
ring (:mod:`syncless.capture.drain.staging`), the windows
(:mod:`syncless.capture.drain.windows`) and their reports
(:mod:`syncless.capture.drain.window_reports`), batching without windows
(:mod:`syncless.capture.drain.batching`) and the requests of other threads
(:mod:`syncless.capture.drain.requests`).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from syncless.capture.boundary import BoundaryClock
from syncless.capture.controller import GrantController
from syncless.capture.drain.batching import DrainBatching
from syncless.capture.drain.requests import MAX_INFLIGHT, DrainRequests, Request
from syncless.capture.drain.staging import StagingCopier
from syncless.capture.drain.transfers import DrainTransfers
from syncless.capture.drain.window_reports import WindowReport, WindowReporter
from syncless.capture.drain.windows import DrainWindows, Plan
from syncless.capture.ring.records import Record, RecordQueue
from syncless.capture.stats import CaptureStats, DropReason
from syncless.capture.writer import SinkWriter
from syncless.cuda_driver import driver
from syncless.hot_path import hot_path

__all__ = ["DrainWorker", "WindowReport"]


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
        copy_held: Callable[[list[Record]], list[DropReason | None]] | None = None,
    ) -> None:
        self._queue = queue
        self._device = ring.device
        self._timeline = boundary.timeline
        self._writer = writer
        self._stats = stats
        self._poll = poll_interval_s
        self._eager = False  # planned windows: every capture wakes the drain to plan
        # Batching (no windows): captures leave their landing event to the drain
        # (syncless.capture.ring.copier explains why, and why not in windows).
        self.defer_landing = True
        self._planned = planned
        self.error: BaseException | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._staging = StagingCopier(
            ring=ring, staging=staging, align=queue.ring.align, timeline=self._timeline, rank=rank
        )
        self._reporter = WindowReporter(
            boundary=boundary,
            controller=controller,
            controller_lock=controller_lock,
            stats=stats,
            late_issue_s=late_issue_s,
            reports=reports,
        )
        self._transfers = DrainTransfers(
            queue=queue,
            staging=self._staging,
            timeline=self._timeline,
            writer=writer,
            reporter=self._reporter,
            stats=stats,
            copy_held=copy_held,
        )
        self._windows = DrainWindows(
            transfers=self._transfers,
            boundary=boundary,
            controller=controller,
            controller_lock=controller_lock,
            staging=self._staging,
            reporter=self._reporter,
            stats=stats,
            wake=self._wake,
            sleep=self._sleep,
            planned=planned,
        )
        self._batching = DrainBatching(
            queue=queue,
            staging=self._staging,
            transfers=self._transfers,
            sleep=self._sleep,
            poll_interval_s=poll_interval_s,
            gather_bytes=gather_bytes,
            gather_s=gather_s,
            batch_bytes=batch_bytes,
        )
        self._requests = DrainRequests(
            queue=queue,
            transfers=self._transfers,
            windows=self._windows,
            batching=self._batching,
            staging=self._staging,
            writer=writer,
            stats=stats,
            controller=controller,
            controller_lock=controller_lock,
            planned=planned,
        )

    # -- requests from other threads ----------------------------------------------------

    def request(self, kind: str, need: int = 0) -> Request:
        """Drain outside the windows: ``lifecycle`` (everything captured so far, written
        by the sink), ``capacity`` (everything captured so far, out of the ring) or
        ``block`` (until a record of ``need`` bytes fits)."""
        req = Request(kind, self._queue.last_seq, need)
        self._requests.submit(req)
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

    def take_error(self) -> BaseException | None:
        """What killed the worker, if not taken yet (strict mode raises it once)."""
        err, self.error = self.error, None
        return err

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
        self._windows.drop_plan()
        if self._thread is not None:
            self._stopping = True
            self._wake.set()
            self._thread.join()
            self._thread = None
        self._reporter.abandon(report=self.error is None)

    def release_staging(self) -> None:
        """The writer is done with the oldest staged batch (records may wait for it)."""
        self._staging.release()
        self._wake.set()

    def staging_used(self) -> int:
        return self._staging.used()

    # -- windows, for the engine ------------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        """The window copy that ``advance_boundary()`` launches at its OPEN, if any."""
        return self._windows.plan

    @property
    def wake_at(self) -> int:
        """``advance_boundary()`` wakes the drain when it publishes this count (-1: never)."""
        return self._windows.wake_at

    @property
    def reports(self) -> deque[WindowReport]:
        """The latest window transfers reported to the controller, oldest first."""
        return self._reporter.reports

    @hot_path
    def launch_plan(self, version: int, boundary: int) -> None:
        """``advance_boundary()`` published ``boundary``: launch the planned copy if it
        waits for it (:meth:`DrainWindows.launch_plan`)."""
        self._windows.launch_plan(version, boundary)

    def _idle(self) -> None:
        """Nothing moved this iteration: sleep until something can.

        With a copy in flight, until it lands (the next copy can only start after it on
        the copy stream anyway; a window copy's outcome is judged from device stamps,
        not from when the drain looks). Batching (no windows), see
        :meth:`DrainBatching.idle`; a request, staging space given back, a pattern,
        suspend or resume wake it at once. With windows on the device and nothing in
        flight, until the stream reaches the next boundary: windows open and close only
        there (:meth:`DrainWindows.idle`). These waits release the GIL. Polling instead,
        every ``poll_interval_s``, took the GIL thousands of times a second from a
        host-bound training thread. Otherwise (windows on the CPU, a boundary the host
        has not published yet) look again after ``poll_interval_s`` or when woken.
        """
        windowed = self._windows.active()
        inflight = self._transfers.inflight
        if inflight and (self._timeline.blocks or not windowed):
            self._timeline.wait(inflight[0].end)
            return
        if not windowed:
            self._batching.idle(self.background)
            return
        if not self._windows.idle():
            self._sleep(self._poll)

    def _sleep(self, timeout_s: float) -> None:
        """Until woken (``notify``, a request, staging space) or ``timeout_s``."""
        self._wake.wait(timeout_s)
        # Cleared before the next look at the ring: a wake after this is not lost.
        self._wake.clear()

    def notify(self) -> None:
        """Something changed that an idle drain must see now: wake it."""
        self._wake.set()

    @hot_path
    def captured(self, held: bool = False) -> None:
        """A record was captured (``held``: its copy deferred to the drain): wake the
        drain if it is parked, if ``gather_bytes`` wait in the ring or half the record
        slots are taken (or always, for planned windows, which plan as soon as records
        are ready). Nothing else wakes it before ``gather_s``: deferred copies wait for
        that look too. The unlocked count may lose an update to a race with the
        drain's reset; the drain's next look enqueues that copy anyway."""
        batching = self._batching
        if held:
            batching.held += 1
        wake = self._wake
        if wake.is_set():
            return  # set() would take its lock anyway: 4.58 -> 3.40 us a capture (CPU, inline)
        queue = self._queue
        if (
            self._eager
            or batching.parked
            # The ring's bytes, as the drain judges them (not a count since its last
            # look, which would need gather_bytes more on top of what it left behind).
            or queue.ring.live_bytes >= batching.gather_bytes
            or len(queue) >= batching.slots_wake
        ):
            wake.set()

    # -- the loop ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._device.type == "cuda":
                # This thread's driver calls (deferred copies, landing events) need the
                # device's context current; torch makes it so. Relaxed capture mode: its
                # event queries and copies must not invalidate a CUDA graph the training
                # thread captures meanwhile (it never enqueues on a capturing stream).
                torch.cuda.set_device(self._device)
                drv = driver()
                if drv is not None:
                    drv.relax_capture_mode()
            while not self._stopping:
                start = time.thread_time()
                moved = self.step()
                self._stats.look(time.thread_time() - start)
                if not moved:
                    self._idle()
        except BaseException as e:
            self._die(e)

    def _die(self, err: BaseException) -> None:
        self._windows.abandon_plan()  # nothing is launched for a dead drain
        # In this order: a request done by fail() finds the error set.
        self.error = err
        self._queue.fail()
        self._requests.fail()
        print(
            f"syncless: capture drain worker failed ({err!r}); new captures are dropped "
            f"(drain_error) and records left in the ring are counted as dropped at close()",
            file=sys.stderr,
        )

    def step(self) -> bool:
        """One iteration (the module docstring's steps); True if anything moved."""
        self._windows.absorb_launched()
        progressed = self._transfers.finish()
        self._windows.observe()
        progressed |= self._requests.serve()
        windowed = self._windows.active()
        self._eager = self._planned and windowed
        self.defer_landing = not windowed
        if not self._requests and len(self._transfers.inflight) < MAX_INFLIGHT:
            if windowed:
                progressed |= self._windows.serve()
            else:
                if self._planned:
                    self._windows.drop_plan()  # suspended or fallen back: batching takes them
                progressed |= self._batching.batch(self.background)
        self._writer.poll()
        return progressed
