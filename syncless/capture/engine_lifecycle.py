"""The capture engine's phases and its end: windows declared, suspended and resumed; the
drain polled and flushed; the engine closed.

None of this runs inside a step's hot path: a pattern is declared once, suspend and
resume bracket phases such as evaluation, and flush and close are host waits for the
end of a phase or of the run.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from syncless.capture.boundary import BoundaryClock
from syncless.capture.controller import GrantController
from syncless.capture.drain import DrainWorker
from syncless.capture.records import VOID, RecordQueue
from syncless.capture.stats import CaptureStats, DropReason
from syncless.capture.windows import WindowPattern
from syncless.capture.writer import SinkWriter

if TYPE_CHECKING:
    from syncless.capture.engine import CaptureEngine
    from syncless.run import Run

__all__ = ["EngineLifecycle"]


class EngineLifecycle:
    """Windows, ``poll``, ``flush`` and ``close`` for
    :class:`~syncless.capture.engine.CaptureEngine`.

    A mixin: the attributes below, ``_raise_errors`` and ``report`` come from
    ``CaptureEngine.__init__``, :mod:`syncless.capture.engine` and
    :class:`~syncless.capture.engine_report.EngineReporting`.
    """

    _background: bool
    _closed: bool
    _strict: bool
    _run: Run | None
    _last_step: int
    _stats: CaptureStats
    _queue: RecordQueue
    _boundary: BoundaryClock
    _drain: DrainWorker
    _writer: SinkWriter
    _ctl: GrantController
    _ctl_lock: threading.Lock

    # -- windows ------------------------------------------------------------------------

    def define_pattern(
        self, pattern: WindowPattern, stream: torch.cuda.Stream | None = None
    ) -> int:
        """Declare recurring windows; returns the pattern's version.

        Boundaries count from 0 again under a new pattern, ordered on ``stream`` (default:
        the current stream) with the boundaries published there. Redefining the current
        pattern keeps its version, its count and what the controller learnt.
        """
        self._check_open("define_pattern")
        with self._ctl_lock:
            before = self._ctl.version
            version = self._ctl.define_pattern(pattern)
        if version != before:
            self._boundary.set_version(version, stream)
        self._drain.notify()  # an idle batching drain sleeps until told
        return version

    def suspend(self) -> None:
        """Enter a phase without windows (evaluation): the drain batches, nothing counts
        against the windows, and nothing in it can trigger the fallback."""
        self._check_open("suspend")
        with self._ctl_lock:
            self._ctl.suspend()
        self._drain.notify()

    def resume(self) -> None:
        """Leave the phase entered by :meth:`suspend`."""
        self._check_open("resume")
        with self._ctl_lock:
            self._ctl.resume()
        self._drain.notify()

    # -- the drain, flushed and closed ----------------------------------------------------

    def poll(self) -> bool:
        """Run one drain iteration on this thread (``background=False`` only)."""
        if self._background:
            raise RuntimeError("poll() is for background=False engines: the drain runs itself")
        if self._closed:
            return False
        return self._drain.step()

    def flush(self) -> None:
        """Wait until every record captured so far is stored (or dropped and counted).

        A host wait, outside any window: for the end of a phase, not for every step.
        """
        if self._strict:
            self._raise_errors()
        if self._closed or self._drain.error is not None:
            return
        self._drain.wait(self._drain.request("lifecycle"))
        if self._strict:
            self._raise_errors()

    def close(self, step: int | None = None) -> None:
        """Drain and store everything, stop the threads, close the sink. Idempotent.

        A closed engine refuses captures (each counted as dropped, reason ``closed``)
        and cannot be reopened. With a ``run``, a last :meth:`report` goes out at
        ``step`` (default: the last step reported).
        """
        if self._closed:
            return
        self._closed = True
        self._queue.close()
        if self._drain.error is None:
            self._drain.wait(self._drain.request("lifecycle"))
        self._drain.stop()
        if self._drain.error is not None:
            self._count_lost()
        self._writer.close()
        if self._run is not None:
            self.report(self._last_step if step is None else step)
        if self._strict:
            self._raise_errors()

    def __enter__(self) -> CaptureEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}(): the capture engine is closed (it cannot be reopened)")

    def _count_lost(self) -> None:
        """The drain died: what is left in the ring will never be stored."""
        count = nbytes = 0
        for i in range(len(self._queue)):
            rec = self._queue.peek(i)
            rec.source = rec.kept = None  # a deferred copy's tensor: not needed now
            if rec.state != VOID:
                count += 1
                nbytes += rec.nbytes
        if count:
            self._stats.drop(DropReason.DRAIN_ERROR, nbytes, count)
