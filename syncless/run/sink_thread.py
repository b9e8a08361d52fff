"""A base for sinks that hand their records to a writer thread of their own.

The TensorBoard and wandb sinks subclass :class:`ThreadedSink`: ``write`` only
enqueues, so the training thread never waits on a summary writer or a wandb socket.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from syncless.run.records import StepRecord, StepRecords

_STOP = object()


class ThreadedSink:
    """Records go to ``consume`` on a writer thread, in the order they were written.

    A subclass overrides ``open`` (called once on the writer thread, before the first
    batch), ``consume`` (one batch) and ``finish`` (after the last batch). An error on
    the writer thread is kept and raised from the next ``write`` or ``close``, so a
    :class:`~syncless.run.Run` counts it like any other sink error. When ``open``
    fails, the sink disables itself: that error is raised once, later batches are
    dropped.
    """

    def __init__(self, thread_name: str, close_timeout_s: float = 120.0) -> None:
        self.close_timeout_s = close_timeout_s
        self.disabled = False
        self._error: BaseException | None = None
        self._closed = False
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def open(self) -> None:
        """Set up the writer (on the writer thread)."""

    def consume(self, records: StepRecords) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Flush and close the writer (on the writer thread)."""

    def write(self, records: Sequence[StepRecord]) -> None:
        self._raise_pending()
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}.write after close()")
        if self.disabled or not records:
            return
        if not self._thread.is_alive():
            self._thread.start()  # on the first batch: a sink that gets none opens nothing
        # Columns stay columns and are shared; anything else is copied, as the caller
        # may reuse its list.
        batch = records if isinstance(records, StepRecords) else list(records)
        self._queue.put(batch)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(self.close_timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(
                    f"{type(self).__name__} still writing after {self.close_timeout_s} s; "
                    "its last records may be lost"
                )
        self._raise_pending()

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"{type(self).__name__} failed: {err}") from err

    def _run(self) -> None:
        try:
            self.open()
        except Exception as e:  # raised on the caller's thread by the next write
            self._error, self.disabled = e, True
        while (item := self._queue.get()) is not _STOP:
            if self.disabled:
                continue  # drained, so that close() still finds the stop
            batch = StepRecords()
            batch.extend(item)
            try:
                self.consume(batch)
            except Exception as e:
                self._error = e
        if not self.disabled:
            try:
                self.finish()
            except Exception as e:
                self._error = e
