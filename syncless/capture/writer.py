"""The sink writer: staged batches to the sink, off the drain worker's thread.

The drain worker hands over each batch once its D2H copy has landed in the pinned
staging ring. The writer gathers batches into shards (up to ``shard_bytes``, or
whatever is waiting after ``shard_interval_s``, at a flush, or when the drain needs
staging space back), calls ``sink.write`` once per shard, and then releases the
batches' staging space. Writing on its own thread keeps a slow disk from delaying the
drain's next copy, which may have to start at a window's OPEN.

A sink that raises never reaches the training step: the shard's records are counted
as dropped (``sink_error``), the first error is kept for ``strict`` mode, and the
writer goes on with the next shard.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from syncless.capture.sink import CapturedRecord, CaptureSink
from syncless.capture.stats import CaptureStats, DropReason

__all__ = ["Batch", "SinkWriter"]

_KICK = object()
_STOP = object()


@dataclass
class Batch:
    """Records whose bytes are on the host; ``staged`` if they hold staging space."""

    records: list[CapturedRecord]
    nbytes: int  # bytes of record data (what the sink stores)
    staged: bool


class SinkWriter:
    """Writes batches to ``sink`` in shards, on a thread or (``background=False``) inline.

    Args:
        sink: where the records go.
        release_staging: called once per staged batch after it is written (or failed),
            oldest first: gives its staging space back.
        stats: the engine's counters.
        shard_bytes: write a shard once this many bytes are waiting.
        shard_interval_s: ... or once the oldest waiting batch is this old.
        background: write on a thread of its own (False: on the caller's thread).
    """

    def __init__(
        self,
        sink: CaptureSink,
        release_staging: Callable[[], None],
        stats: CaptureStats,
        shard_bytes: int,
        shard_interval_s: float,
        background: bool,
    ) -> None:
        self._sink = sink
        self._release_staging = release_staging
        self._stats = stats
        self._shard_bytes = shard_bytes
        self._interval = shard_interval_s
        self._pending: list[Batch] = []
        self._pending_bytes = 0
        self._since = 0.0  # monotonic time of the oldest pending batch
        self.error: BaseException | None = None  # the first sink error, for strict mode
        self._queue: queue.Queue[object] = queue.Queue()
        self._kicked = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="syncless-capture-writer")
            self._thread.daemon = True
            self._thread.start()

    @property
    def thread(self) -> threading.Thread | None:
        """The writer thread (None inline or once closed)."""
        return self._thread

    def submit(self, batch: Batch) -> None:
        """A batch whose bytes have landed (called by the drain, in capture order)."""
        if self._thread is not None:
            self._queue.put(batch)
        else:
            self._add(batch)
            self._write_if_due()

    def kick(self) -> None:
        """Write what is waiting now: the drain needs staging space back."""
        if self._thread is None:
            self._write()
        elif not self._kicked:  # the drain asks every poll; one kick in the queue is enough
            self._kicked = True
            self._queue.put(_KICK)

    def flush(self) -> None:
        """Write every batch submitted so far and wait until the sink has it."""
        if self._thread is not None:
            done = threading.Event()
            self._queue.put(done)
            done.wait()
        else:
            self._write()

    def poll(self) -> None:
        """Inline mode: write a shard if one is due by time."""
        if self._thread is None:
            self._write_if_due()

    def close(self) -> None:
        """Write everything, stop the thread, close the sink (errors counted, not raised)."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None
        else:
            self._write()
        try:
            self._sink.close()
        except Exception as e:
            self._failed(e)

    # -- internals --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            timeout = None
            if self._pending:
                timeout = max(0.0, self._interval - (time.monotonic() - self._since))
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            if isinstance(item, Batch):
                self._add(item)
                self._write_if_due()
            elif item is None or item is _KICK:
                self._kicked = self._kicked and item is None
                self._write()
            elif isinstance(item, threading.Event):
                self._write()
                item.set()
            elif item is _STOP:
                self._write()
                return

    def _add(self, batch: Batch) -> None:
        if not self._pending:
            self._since = time.monotonic()
        self._pending.append(batch)
        self._pending_bytes += batch.nbytes

    def _write_if_due(self) -> None:
        if self._pending and (
            self._pending_bytes >= self._shard_bytes
            or time.monotonic() - self._since >= self._interval
        ):
            self._write()

    def _write(self) -> None:
        if not self._pending:
            return
        batches, self._pending, self._pending_bytes = self._pending, [], 0
        records = [r for b in batches for r in b.records]
        nbytes = sum(b.nbytes for b in batches)
        try:
            if records:
                self._sink.write(records)
        except Exception as e:
            self._stats.drop(DropReason.SINK_ERROR, nbytes, len(records))
            self._failed(e)
        else:
            if records:
                self._stats.add2("stored_count", len(records), "stored_bytes", nbytes)
                self._stats.add("sink_shards_count")
        finally:
            # The sink is done with the staging views (written or failed): reuse them.
            for b in batches:
                if b.staged:
                    self._release_staging()

    def _failed(self, err: BaseException) -> None:
        self._stats.add("sink_errors_count")
        if self.error is None:
            self.error = err
            print(
                f"syncless: capture sink {type(self._sink).__name__} failed ({err!r}); "
                f"its records are counted as dropped (sink_error), further errors counted",
                file=sys.stderr,
            )
