"""SinkWriter's pool: several shards in flight, staging released in submission order.

Every batch here is its own shard (``shard_bytes=1``). Sinks hold each write at a gate
the test opens, so which shards are in flight is set by the test, never by timing.
Ground truth is what the sinks saw and the order the staging releases came in.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from syncless.capture import (
    CapturedRecord,
    CaptureSink,
    FsspecSink,
    MemorySink,
    SafetensorsSink,
)
from syncless.capture import open as open_captures
from syncless.capture.stats import CaptureStats
from syncless.capture.writer import Batch, SinkWriter
from syncless.errors import UsageError

WAIT_S = 30.0  # a guard against hanging the suite, never a synchronization


def record(seq: int, tensor: torch.Tensor) -> CapturedRecord:
    data = tensor.contiguous().reshape(-1).view(torch.uint8)
    shape, dtype = tuple(tensor.shape), tensor.dtype
    return CapturedRecord(seq, f"t{seq % 3}", seq // 4, 0, shape, dtype, data.numel(), None, data)


def batch(seq: int, n: int = 1) -> Batch:
    """``n`` float32 records of 4 floats each, numbered from ``seq``."""
    records = [record(seq + i, torch.full((4,), float(seq + i))) for i in range(n)]
    return Batch(records, sum(r.nbytes for r in records), staged=True)


class Releases:
    """The staging ring's side: which shard each release freed, checked as it happens.

    A FIFO ring frees its oldest batch first, so the k-th release frees the k-th
    submitted batch: that batch's write must be over by then.
    """

    def __init__(self, sink: GatedSink, order: list[int]) -> None:
        self.sink, self.order = sink, order  # first record seq of each batch, as submitted
        self.freed: list[int] = []
        self.early: list[int] = []  # batches released while their write was not over

    def __call__(self) -> None:
        first = self.order[len(self.freed)]
        if first not in self.sink.finished:
            self.early.append(first)
        self.freed.append(first)


class GatedSink:
    """Each write (named by its first record's seq) waits until its gate is opened."""

    def __init__(self, fail: int | None = None) -> None:
        self.fail = fail  # this shard raises once its gate opens
        self.state = threading.Condition()
        self.gates: dict[int, threading.Event] = {}
        self.active = 0
        self.max_active = 0
        self.started: list[int] = []
        self.finished: list[int] = []
        self.written: list[int] = []  # record seqs that reached the sink

    def gate(self, first: int) -> threading.Event:
        with self.state:
            return self.gates.setdefault(first, threading.Event())

    def write(self, records: Sequence[CapturedRecord]) -> None:
        first = records[0].seq
        with self.state:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.started.append(first)
            self.state.notify_all()
        try:
            assert self.gate(first).wait(WAIT_S), f"shard {first} was never let through"
            if first == self.fail:
                raise OSError(f"disk full at shard {first}")
            with self.state:
                self.written += [r.seq for r in records]
        finally:
            with self.state:
                self.active -= 1
                self.finished.append(first)
                self.state.notify_all()

    def wait_until(self, condition: Callable[[], bool]) -> None:
        with self.state:
            assert self.state.wait_for(condition, WAIT_S)

    def close(self) -> None:
        pass


def pooled(
    sink: CaptureSink, releases: Callable[[], None], workers: int, stats: CaptureStats | None = None
) -> SinkWriter:
    # shard_bytes=1: every batch is a shard at once. The interval never fires.
    stats = stats or CaptureStats()
    return SinkWriter(sink, releases, stats, 1, 3600.0, True, workers=workers)


def test_the_pool_writes_as_many_shards_at_once_as_it_has_workers() -> None:
    sink = GatedSink()
    order = list(range(12))
    releases = Releases(sink, order)
    writer = pooled(sink, releases, workers=4)
    for seq in order:
        writer.submit(batch(seq))
    sink.wait_until(lambda: sink.active == 4)
    assert sorted(sink.started) == [0, 1, 2, 3]
    for seq in order:
        sink.gate(seq).set()
    writer.flush()
    assert sink.max_active == 4  # never more than the workers: the gathering thread waits
    assert sorted(sink.written) == order
    assert releases.freed == order and releases.early == []
    assert len(writer.threads) == 5 and writer.thread in writer.threads
    writer.close()
    assert writer.threads == [] and writer.thread is None


def test_later_shards_go_on_past_a_slow_one_and_release_after_it() -> None:
    sink = GatedSink()
    order = list(range(6))
    releases = Releases(sink, order)
    writer = pooled(sink, releases, workers=2)
    for seq in order:
        writer.submit(batch(seq))
    for seq in order[1:]:
        sink.gate(seq).set()
    # Shard 0 holds one worker; the other writes 1 to 5 meanwhile.
    sink.wait_until(lambda: sorted(sink.finished) == [1, 2, 3, 4, 5])
    assert releases.freed == []  # shard 0 still holds the front of the staging ring
    sink.gate(0).set()
    writer.flush()
    assert sink.finished[-1] == 0 and sink.max_active == 2
    assert releases.freed == order and releases.early == []
    writer.close()


def test_a_failing_shard_drops_exactly_its_records_while_the_others_are_stored(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sink = GatedSink(fail=6)
    sizes = [1, 3, 2, 4, 1, 2]  # records per batch
    firsts = [sum(sizes[:i]) for i in range(len(sizes))]  # 0, 1, 4, 6, 10, 11
    releases = Releases(sink, firsts)
    stats = CaptureStats()
    writer = pooled(sink, releases, workers=4, stats=stats)
    for first, n in zip(firsts, sizes, strict=True):
        writer.submit(batch(first, n))
    sink.wait_until(lambda: sink.active == 4)
    sink.gate(6).set()  # the failing shard (4 records) ends while the older three write
    sink.wait_until(lambda: sink.finished == [6])
    assert stats["dropped_sink_error_count"] == 4 and stats["stored_count"] == 0
    assert releases.freed == []
    for first in firsts:
        sink.gate(first).set()
    writer.flush()
    assert stats["dropped_sink_error_count"] == 4 and stats["dropped_sink_error_bytes"] == 4 * 16
    assert stats["stored_count"] == 9 and stats["stored_bytes"] == 9 * 16
    assert stats["sink_shards_count"] == 5 and stats["sink_errors_count"] == 1
    assert sorted(sink.written) == [s for s in range(13) if s not in (6, 7, 8, 9)]
    assert releases.freed == firsts and releases.early == []  # the failed one released too
    assert isinstance(writer.error, OSError) and "shard 6" in str(writer.error)
    writer.close()
    assert capsys.readouterr().err.count("disk full") == 1


def test_flush_returns_only_once_every_shard_is_written_and_released() -> None:
    sink = GatedSink()
    releases = Releases(sink, [0, 1, 2, 3])
    stats = CaptureStats()
    writer = pooled(sink, releases, workers=4, stats=stats)
    for seq in range(4):
        writer.submit(batch(seq))
    sink.wait_until(lambda: sink.active == 4)
    seen_at_return: list[tuple[float, int]] = []
    flushed = threading.Event()

    def flush() -> None:
        writer.flush()
        seen_at_return.append((stats["stored_count"], len(releases.freed)))
        flushed.set()

    flusher = threading.Thread(target=flush)
    flusher.start()
    for seq in (3, 2, 1):
        sink.gate(seq).set()
    sink.wait_until(lambda: len(sink.finished) == 3)
    assert not flushed.is_set()  # shard 0 is still being written
    sink.gate(0).set()
    flusher.join(WAIT_S)
    assert seen_at_return == [(4, 4)]
    writer.close()


class OneAtATimeSink:
    """A sink that declares it cannot take concurrent writes, and checks it."""

    concurrent_writes = False

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.max_active = 0
        self.threads: set[threading.Thread] = set()
        self.written: list[int] = []

    def write(self, records: Sequence[CapturedRecord]) -> None:
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.threads.add(threading.current_thread())
        self.written += [r.seq for r in records]
        with self.lock:
            self.active -= 1

    def close(self) -> None:
        pass


def test_a_sink_without_concurrent_writes_gets_one_writer_whatever_was_asked() -> None:
    sink = OneAtATimeSink()
    released: list[None] = []
    writer = pooled(sink, lambda: released.append(None), workers=8)
    assert len(writer.threads) == 1  # the gathering thread writes, as without a pool
    for seq in range(50):
        writer.submit(batch(seq))
    writer.flush()
    assert sink.max_active == 1 and sink.threads == {writer.thread}
    assert sink.written == list(range(50)) and len(released) == 50
    writer.close()
    assert MemorySink.concurrent_writes is False


def test_inline_mode_stays_single_and_synchronous() -> None:
    sink = OneAtATimeSink()
    sink.concurrent_writes = True  # would take a pool, but inline mode has none
    released: list[None] = []
    writer = SinkWriter(sink, lambda: released.append(None), CaptureStats(), 1, 3600.0, False, 4)
    assert writer.threads == [] and writer.thread is None
    writer.submit(batch(0))
    assert sink.written == [0] and len(released) == 1  # written before submit returned
    writer.close()


def test_a_writer_needs_at_least_one_worker() -> None:
    with pytest.raises(UsageError, match="at least 1 worker"):
        SinkWriter(MemorySink(), lambda: None, CaptureStats(), 1, 1.0, True, workers=0)


@pytest.mark.parametrize("kind", ["safetensors", "fsspec"])
def test_four_workers_write_uniquely_named_shards_that_read_back_byte_exact(
    kind: str, tmp_path: Path
) -> None:
    if kind == "fsspec":
        pytest.importorskip("fsspec")
        sink: SafetensorsSink | FsspecSink = FsspecSink(f"file://{tmp_path}/captures")
    else:
        sink = SafetensorsSink(tmp_path)
    gen = torch.Generator().manual_seed(7)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.complex128]
    originals = []
    released: list[None] = []
    stats = CaptureStats()
    # Shards of 4 KiB or more, from batches of 1 to 3 records: dozens of shards.
    writer = SinkWriter(sink, lambda: released.append(None), stats, 4096, 3600.0, True, 4)
    for b in range(60):
        records = []
        for _ in range(1 + b % 3):
            dtype = dtypes[len(originals) % len(dtypes)]
            n = int(torch.randint(1, 300, (), generator=gen))
            bits = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
            originals.append(bits.view(dtype).clone())
            records.append(record(len(originals) - 1, originals[-1]))
        writer.submit(Batch(records, sum(r.nbytes for r in records), staged=True))
    writer.close()

    assert stats["stored_count"] == len(originals) and stats["sink_errors_count"] == 0
    assert len(released) == 60
    shards = int(stats["sink_shards_count"])
    assert shards > 8 and sink.shards_written == shards
    names = sorted(p.name for p in (tmp_path / "captures").glob("*.safetensors"))
    assert names == [f"rank00000-{i:06d}.safetensors" for i in range(1, shards + 1)]
    store = open_captures(tmp_path)
    assert [row["seq"] for row in store.rows] == list(range(len(originals)))
    for i, x in enumerate(originals):
        got = store.tensor(i)
        assert got.dtype == x.dtype and torch.equal(got.view(torch.uint8), x.view(torch.uint8))
