"""The sink writer: staged batches to the sink, off the drain worker's thread.

The drain worker hands over each batch once its D2H copy has landed in the pinned
staging ring. The writer gathers batches into shards (up to ``shard_bytes``, or
whatever is waiting after ``shard_interval_s``, at a flush, or when the drain needs
staging space back), calls ``sink.write`` once per shard, and then releases the
batches' staging space. Writing on its own thread keeps a slow disk from delaying the
drain's next copy, which may have to start at a window's OPEN.

With ``workers > 1`` a pool of threads writes up to that many shards at once: several
files in flight use an NVMe drive's queue depth and an object store's parallel
uploads. Staging space is still released in submission order, because the staging
ring is FIFO: a shard that finishes early waits for the older ones.

A sink that raises never reaches the training step: the shard's records are counted
as dropped (``sink_error``), the first error is kept for ``strict`` mode, and the
writer goes on with the next shard.
"""

from __future__ import annotations

import errno
import queue
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from syncless.capture.sinks.shards import CapturedRecord, CaptureSink
from syncless.capture.stats import CaptureStats, DropReason
from syncless.errors import UsageError

__all__ = ["Batch", "SinkWriter", "writer_count"]

_KICK = object()
_STOP = object()


@dataclass
class Batch:
    """Records whose bytes are on the host; ``staged`` if they hold staging space."""

    records: Iterable[CapturedRecord]  # a list, or StagedRecords made on iteration
    nbytes: int  # bytes of record data (what the sink stores)
    staged: bool


@dataclass
class _Shard:
    """Batches written by one ``sink.write`` call."""

    batches: list[Batch]
    done: bool = False  # written or failed (its staging is released once older shards are)


def writer_count(sink: CaptureSink, workers: int, background: bool) -> int:
    """Shards written at once: ``workers`` on threads, but one inline (``background``
    false) or for a sink that declares ``concurrent_writes = False``."""
    return workers if background and getattr(sink, "concurrent_writes", True) else 1


# Shards per worker that recent_rate() averages over.
_RECENT_PER_WORKER = 4


class SinkWriter:
    """Writes batches to ``sink`` in shards, on threads or (``background=False``) inline.

        writer = SinkWriter(sink, drain.release_staging, stats, 64 << 20, 1.0, True, workers=4)
        writer.submit(Batch(records, nbytes, staged=True))
        writer.flush()  # every shard so far written and its staging released

    Args:
        sink: where the records go.
        release_staging: called once per staged batch after it is written (or failed),
            oldest first: gives its staging space back.
        stats: the engine's counters.
        shard_bytes: write a shard once this many bytes are waiting.
        shard_interval_s: ... or once the oldest waiting batch is this old.
        background: write on threads of their own (False: on the caller's thread).
        workers: shards written at once (background only; 1 for a sink that declares
            ``concurrent_writes = False``).
    """

    def __init__(
        self,
        sink: CaptureSink,
        release_staging: Callable[[], None],
        stats: CaptureStats,
        shard_bytes: int,
        shard_interval_s: float,
        background: bool,
        workers: int = 1,
    ) -> None:
        if workers < 1:
            raise UsageError(f"the sink writer needs at least 1 worker, got workers={workers}")
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
        # Shards handed to the sink whose staging is not released yet, oldest first.
        self._inflight: deque[_Shard] = deque()
        self._writing = 0  # of those, the ones the sink is still writing
        self._lock = threading.Condition()  # guards _inflight, _writing and error
        self._workers = writer_count(sink, workers, background)
        # (bytes, seconds) of the last shards written, for recent_rate().
        self._recent: deque[tuple[int, float]] = deque(maxlen=_RECENT_PER_WORKER * self._workers)
        self._shards: queue.Queue[_Shard | None] = queue.Queue()  # for the pool
        self._pool: list[threading.Thread] = []
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="syncless-capture-writer")
            self._thread.daemon = True
            self._thread.start()
        if self._workers > 1:
            for i in range(self._workers):
                name = f"syncless-capture-writer-{i + 1}"
                self._pool.append(threading.Thread(target=self._work, name=name, daemon=True))
                self._pool[-1].start()

    @property
    def thread(self) -> threading.Thread | None:
        """The thread that gathers shards (None inline or once closed)."""
        return self._thread

    @property
    def threads(self) -> list[threading.Thread]:
        """Every writer thread: the gathering one and the pool's (empty inline or closed)."""
        return [t for t in (self._thread, *self._pool) if t is not None and t.is_alive()]

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
        """Write everything, stop the threads, close the sink (errors counted, not raised)."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None
            for _ in self._pool:
                self._shards.put(None)
            for t in self._pool:
                t.join()
            self._pool = []
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
                self._wait_released()
                item.set()
            elif item is _STOP:
                self._write()
                self._wait_released()
                return

    def _work(self) -> None:
        """A pool thread: writes the shards it is handed until told to stop (None)."""
        while (shard := self._shards.get()) is not None:
            self._store(shard)

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
        """Hand the pending batches to the sink as one shard (on a pool thread if any)."""
        if not self._pending:
            return
        shard = _Shard(self._pending)
        self._pending, self._pending_bytes = [], 0
        with self._lock:
            # Wait for a free worker rather than queue shards for the pool. Written shards
            # that wait for an older one hold staging: the staging ring bounds those.
            self._lock.wait_for(lambda: self._writing < self._workers)
            self._writing += 1
            self._inflight.append(shard)
        if self._pool:
            self._shards.put(shard)
        else:
            self._store(shard)

    def _store(self, shard: _Shard) -> None:
        records = [r for b in shard.batches for r in b.records]
        nbytes = sum(b.nbytes for b in shard.batches)
        start = time.perf_counter()
        try:
            if records:
                self._sink.write(records)
        except Exception as e:
            self._stats.drop(DropReason.SINK_ERROR, nbytes, len(records))
            self._failed(e)
        else:
            if records:
                seconds = time.perf_counter() - start
                self._recent.append((nbytes, seconds))  # atomic under the GIL
                self._stats.add2("stored_count", len(records), "stored_bytes", nbytes)
                self._stats.add2("sink_shards_count", 1, "sink_ms", seconds * 1e3)
        finally:
            self._release(shard)

    def recent_rate(self) -> tuple[float, int] | None:
        """The sink's write rate over its last shards, all workers together (GB/s), and
        how many shards that is; None before the first. Where the disk's page cache
        takes the first minutes at memory speed, this is the rate it keeps after:
        the average since the start said 7.46 GB/s on an H200 host whose disk took
        1.1 GB/s by then (bench/capture/soak.py, 2b8154f)."""
        shards = list(self._recent)
        seconds = sum(s for _, s in shards)
        if not shards or seconds <= 0:
            return None
        busy = seconds / min(self._workers, len(shards))  # the workers write side by side
        return sum(n for n, _ in shards) / busy / 1e9, len(shards)

    def _release(self, shard: _Shard) -> None:
        """``shard`` is done: release the staging of the finished shards at the front of
        the line, oldest first (the staging ring is FIFO)."""
        with self._lock:
            self._writing -= 1
            shard.done = True
            while self._inflight and self._inflight[0].done:
                # The sink is done with the staging views (written or failed): reuse them.
                for b in self._inflight.popleft().batches:
                    if b.staged:
                        self._release_staging()
            self._lock.notify_all()

    def take_error(self) -> BaseException | None:
        """The first sink error not taken yet (strict mode raises it once), or None."""
        with self._lock:
            err, self.error = self.error, None
        return err

    def _wait_released(self) -> None:
        """Until every shard handed to the sink is written and its staging released."""
        with self._lock:
            self._lock.wait_for(lambda: not self._inflight)

    def _failed(self, err: BaseException) -> None:
        self._stats.add("sink_errors_count")
        with self._lock:  # pool threads fail at once: one of them is the first
            first = self.error is None
            if first:
                self.error = err
        if first:
            print(
                f"syncless: capture sink {type(self._sink).__name__} failed ({err!r}); "
                f"its records are counted as dropped (sink_error), further errors counted"
                f"{full_volume_hint(self._sink, err, self._stats)}",
                file=sys.stderr,
            )


def full_volume_hint(sink: CaptureSink, err: BaseException, stats: CaptureStats) -> str:
    """For a full volume or quota: how much the volume has free and what the sink
    stored, so the reader knows whether their own shards filled it. '' otherwise."""
    if not (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)):
        return ""
    stored_gb = stats.snapshot().get("stored_bytes", 0) / 1e9
    folder = getattr(sink, "dir", None)
    try:
        free = f"{shutil.disk_usage(folder).free / 1e9:.2f} GB free under {folder}, "
    except (OSError, TypeError):  # not a local directory (an fsspec URL) or gone
        free = ""
    return (
        f". The volume is full: {free}{stored_gb:.2f} GB stored by this engine. Free or "
        f"move shards (a volume mounted with discard can hand deleted space back late: "
        f"docs/capture.md, the soak), or capture less"
    )
