"""The capture engine's numbers: counters, gauges, drops, and the step records of a run.

:meth:`~EngineReporting.report` sends ``capture/step/*`` (what was offered, stored and
dropped since the last report, and the gauges now) and ``capture/self/*`` (the engine's
own cost: host time in ``capture()`` and ``advance_boundary()``, drain loops, the CPU
time of the drain and writer threads). The counters themselves are kept by
:class:`~syncless.capture.stats.CaptureStats`; here they are read and named.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from syncless.capture.controller import GrantController
from syncless.capture.drain import DrainWorker, WindowReport
from syncless.capture.records import RecordQueue
from syncless.capture.stats import GAUGES, CaptureStats, ThreadClock
from syncless.capture.writer import SinkWriter
from syncless.hot_path import hot_path

if TYPE_CHECKING:
    from syncless.run import Run

__all__ = ["EngineReporting"]

# Counters reported under capture/self/ (the engine's own cost), not capture/step/.
_SELF = (
    "capture_host_ms",
    "boundary_host_ms",
    "drain_loops_count",
    "drain_look_ms",
    "drain_cpu_ms",
    "writer_cpu_ms",
)


class EngineReporting:
    """``report``, ``counters``, ``dropped`` and ``window_reports`` for
    :class:`~syncless.capture.engine.CaptureEngine`.

    A mixin: the attributes below, and ``_raise_errors``, come from
    ``CaptureEngine.__init__`` and :mod:`syncless.capture.engine`.
    """

    _strict: bool
    _run: Run | None
    _last_step: int
    _stats: CaptureStats
    _thread_clock: ThreadClock
    _queue: RecordQueue
    _drain: DrainWorker
    _writer: SinkWriter
    _ctl: GrantController
    _ctl_lock: threading.Lock

    def window_reports(self) -> list[WindowReport]:
        """What the engine reported for each recent window transfer (oldest first)."""
        return list(self._drain.reports)

    def report(self, step: int) -> dict[str, float]:
        """This step's numbers (counters since the last report, gauges now), sent to the
        ``run`` as ``capture/step/*`` and ``capture/self/*`` step records."""
        if self._strict:
            self._raise_errors()
        self._last_step = step
        self._stats.add2(
            "drain_cpu_ms",
            self._thread_clock.advance(self._drain.thread),
            "writer_cpu_ms",
            sum(self._thread_clock.advance(t) for t in self._writer.threads),
        )
        values: dict[str, float] = {}
        for name, value in self._stats.deltas().items():
            values[f"capture/{'self' if name in _SELF else 'step'}/{name}"] = value
        values["capture/self/drain_look_max_ms"] = self._stats.take_look_max()
        gauges = self._gauges()
        values.update({f"capture/step/{name}": gauges[name] for name in GAUGES})
        if self._run is not None:
            self._run.log(step, values)
        return values

    # Marked because CaptureEngine._reserve reads them to explain the first drop for
    # lack of room, and the linter follows calls within one module only.
    @hot_path
    def counters(self) -> dict[str, float]:
        """Every counter, cumulative since the engine started, and the gauges now."""
        return {**self._stats.snapshot(), **self._gauges()}

    def dropped(self) -> dict[str, int]:
        """Dropped records by reason (every reason listed, zeros included)."""
        return self._stats.dropped()

    def _gauges(self) -> dict[str, float]:
        with self._ctl_lock:
            fallback = self._ctl.fallback
        return {
            "pending_count": self._stats.balance(),
            "ring_used_bytes": self._queue.used_bytes(),
            "staging_used_bytes": self._drain.staging_used(),
            "fallback": int(fallback),
        }
