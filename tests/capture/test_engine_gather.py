"""The batching drain gathers captures: one transfer per pile, not one per capture.

Ground truth is the number of captures made and their bytes, counted by the test; the
engine's transfer count (``d2h_count``) must be far below the capture count, and every
record must still reach the sink without a flush (no lost wake-up).
"""

from __future__ import annotations

import threading
import time

import torch

from syncless.capture import CaptureEngine, EngineConfig, MemorySink
from syncless.guard import no_sync

MiB = 1 << 20
RECORD = torch.arange(1024, dtype=torch.float32)  # 4 KiB: a 4096-byte span at align 64


def stored_within(engine: CaptureEngine, count: int, seconds: float) -> bool:
    """Poll the engine's counters (not the drain) until ``count`` records are stored."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if engine.counters()["stored_count"] >= count:
            return True
        time.sleep(0.01)
    return False


def test_captures_pile_up_until_gather_bytes_then_go_in_one_transfer() -> None:
    sink = MemorySink()
    config = EngineConfig(gather_bytes=10 * 4096, gather_interval_s=30.0, shard_interval_s=0.01)
    engine = CaptureEngine(16 * MiB, 4 * MiB, sink, device="cpu", config=config)
    n = 100
    with no_sync():
        for i in range(n):
            engine.capture("x", RECORD, step=i)
            # Releases the GIL: a drain woken by each capture would take each alone.
            time.sleep(0.001)
    transfers = engine.counters()["d2h_count"]
    engine.close()
    # The first capture wakes the parked drain; after that one wake per 10 records.
    assert transfers <= n // 10 + 3, transfers
    assert [r.step for r in sink.records] == list(range(n))
    assert all(torch.equal(t, RECORD) for t in sink.tensors())


def test_half_the_record_slots_wake_the_drain_before_its_gather_ends() -> None:
    """Small captures far below ``gather_bytes``, with a gather of 30 s: the drain
    takes them once half the slots (8 of 16) are in flight, so the slots never run out
    (records_full) before it looks."""
    sink = MemorySink()
    config = EngineConfig(
        max_records=16, gather_bytes=1 << 30, gather_interval_s=30.0, shard_interval_s=0.01
    )
    engine = CaptureEngine(16 * MiB, 4 * MiB, sink, device="cpu", config=config)
    n = 64
    try:
        with no_sync():
            for i in range(n):
                # Never all 16 slots taken: the drain took the first 8 before the 16th.
                assert wait_until(lambda: engine.counters()["ring_used_bytes"] < 12 * 4096)
                assert engine.capture("x", RECORD, step=i)
    finally:
        engine.close()
    assert sum(engine.dropped().values()) == 0
    assert [r.step for r in sink.records] == list(range(n))


def test_a_step_of_small_deferred_captures_costs_the_drain_a_few_looks() -> None:
    """What a GPU-bound step pays for is the drain's looks while the training thread
    enqueues (docs/capture.md, "The drain gathers"): 256 small deferred captures, the
    GIL let go after each, far below every default threshold, must not make it look
    more than once or twice before its gather ends."""
    sink = MemorySink()
    config = EngineConfig(defer_copy_below=1 << 20, gather_interval_s=30.0)
    engine = CaptureEngine(16 * MiB, 4 * MiB, sink, device="cpu", config=config)
    rows = [torch.full((1024,), float(i)) for i in range(256)]
    try:
        time.sleep(0.05)  # the drain parks
        before = engine.counters()["drain_loops_count"]
        with no_sync():
            for i, row in enumerate(rows):
                engine.capture("row", row, step=i)
                time.sleep(0.0005)  # the GIL is free: a drain woken now would look
        looks = engine.counters()["drain_loops_count"] - before
        engine.flush()
    finally:
        engine.close()
    # The first capture wakes the parked drain: one look, then it sleeps out the gather
    # (one more for a wake racing its sleep). A wake every 64 deferred captures made 4.
    assert looks <= 2, looks
    assert [float(r.data.view(torch.float32)[0]) for r in sink.records] == list(range(256))


def test_a_lone_capture_is_stored_without_a_flush() -> None:
    """The parked drain must wake for the first record, then gather for at most
    ``gather_interval_s``: a lost wake-up would leave it in the ring for good."""
    sink = MemorySink()
    config = EngineConfig(gather_bytes=1 << 30, gather_interval_s=0.05, shard_interval_s=0.01)
    engine = CaptureEngine(16 * MiB, 4 * MiB, sink, device="cpu", config=config)
    try:
        for round_ in range(3):
            with no_sync():
                engine.capture("lone", RECORD, step=round_)
            assert stored_within(engine, round_ + 1, seconds=5.0), engine.counters()
    finally:
        engine.close()
    assert [r.step for r in sink.records] == [0, 1, 2]


def test_gather_settings_are_checked() -> None:
    for bad in (dict(gather_bytes=0), dict(gather_interval_s=0.0), dict(gather_bytes=1.5)):
        try:
            EngineConfig(**bad)
        except ValueError as e:
            assert "gather" in str(e)
        else:
            raise AssertionError(f"EngineConfig({bad}) was accepted")


class GatedSink:
    """A sink whose writes wait for the test to open the gate (a slow disk)."""

    concurrent_writes = False

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.written = 0

    def write(self, records) -> None:
        assert self.gate.wait(30), "the test never opened the gate"
        self.written += len(records)

    def close(self) -> None:
        pass


def wait_until(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def test_the_first_drop_behind_a_slow_sink_names_the_sink(capsys) -> None:
    sink = GatedSink()
    record = torch.zeros(64 * 1024 // 4)  # 64 KiB
    engine = CaptureEngine(MiB, 256 * 1024, sink, device="cpu", config=EngineConfig())
    try:
        with no_sync():
            for i in range(4):  # the staging ring's worth
                assert engine.capture("x", record, step=i)
            # The drain fills staging; the writer is stuck in the sink's first write.
            assert wait_until(lambda: engine.counters()["staging_used_bytes"] >= 256 * 1024)
            stored = [engine.capture("x", record, step=4 + i) for i in range(32)]
        assert not all(stored)  # the ring (1 MiB) filled behind the full staging ring
        assert engine.shortfall is not None
        assert "staging ring is full: the sink is the limit" in engine.shortfall
        assert "GatedSink" in engine.shortfall and "ring_full" in engine.shortfall
        assert capsys.readouterr().err.count("dropped its first record") == 1  # once
    finally:
        sink.gate.set()
        engine.close()
    dropped = sum(engine.dropped().values())
    assert sink.written + dropped == 36  # every record stored or counted


class SlowingSink:
    """Writes at memory speed for its first ``fast`` shards, then takes ``delay_s`` per
    shard: a disk whose page cache has filled."""

    concurrent_writes = False

    def __init__(self, fast: int, delay_s: float) -> None:
        self.fast, self.delay_s = fast, delay_s
        self.shards = 0
        self.written = 0

    def write(self, records) -> None:
        self.shards += 1
        if self.shards > self.fast:
            time.sleep(self.delay_s)
        self.written += len(records)

    def close(self) -> None:
        pass


def test_the_first_drop_quotes_the_rate_the_sink_keeps_now_not_its_average(capsys) -> None:
    import re

    record = torch.zeros(MiB // 4)  # 1 MiB: one record per shard
    # The average over 48 fast shards and the ~24 slow ones before the first drop (the
    # ring and staging, 12 MiB, fill at 1 MiB per slow shard) is about 3x the slow rate.
    sink = SlowingSink(fast=48, delay_s=0.02)
    config = EngineConfig(shard_bytes=MiB, writers=1)
    engine = CaptureEngine(8 * MiB, 4 * MiB, sink, device="cpu", config=config)
    try:
        with no_sync():
            for i in range(48):  # the fast shards, each stored before the next capture
                assert engine.capture("x", record, step=i)
                assert wait_until(lambda i=i: sink.written == i + 1)
            step = 48
            while engine.shortfall is None and step < 500:
                # Twice what the slow sink takes: the ring and staging (12 MiB) fill in
                # about a quarter second, a dozen slow shards.
                engine.capture("x", record, step=step)
                time.sleep(0.01)
                step += 1
    finally:
        engine.close()
    text = engine.shortfall
    assert text is not None and "the sink is the limit" in text
    found = re.search(r"writes ([0-9.]+) GB/s over its last (\d+) shards \(([0-9.]+) GB/s", text)
    assert found, text
    recent, shards, average = float(found[1]), int(found[2]), float(found[3])
    assert shards == 4  # 4 per worker, one worker
    slow = MiB / 0.02 / 1e9  # 0.05 GB/s: what a slow shard takes at least
    assert 0.25 * slow <= recent <= 1.05 * slow, text  # the slow shards (a busy host: slower)
    assert average > 2 * recent  # the fast shards lift the average, not the advice
    assert f"Keep the volume under {recent:.2f} GB/s" in text


def test_a_burst_into_a_ring_nobody_drains_names_the_ring(capsys) -> None:
    record = torch.zeros(64 * 1024 // 4)
    engine = CaptureEngine(MiB, 256 * 1024, MemorySink(), device="cpu", background=False)
    with no_sync():
        stored = [engine.capture("x", record, step=i) for i in range(20)]
    assert stored.count(True) == 16  # 1 MiB of 64 KiB records; no poll() drained any
    assert "MiB device ring filled faster than the drain emptied it" in engine.shortfall
    assert "1 MiB device ring" in engine.shortfall
    engine.close()
    assert capsys.readouterr().err.count("dropped its first record") == 1


def test_running_out_of_record_slots_names_the_slots() -> None:
    config = EngineConfig(max_records=4)
    engine = CaptureEngine(
        MiB, 256 * 1024, MemorySink(), device="cpu", background=False, config=config
    )
    with no_sync():
        stored = [engine.capture("x", RECORD, step=i) for i in range(6)]
    assert stored == [True] * 4 + [False] * 2  # 4 slots; the ring had room for all six
    assert engine.shortfall is not None and "records_full" in engine.shortfall
    assert "Every record slot is in flight" in engine.shortfall
    engine.close()
    assert engine.dropped()["records_full"] == 2


def test_a_background_drain_stores_captures_of_zero_bytes() -> None:
    """An empty tensor takes no ring bytes but is a record: the gathering drain must
    still take it (it once counted bytes only, found none waiting and died)."""
    sink = MemorySink()
    engine = CaptureEngine(1 << 20, 1 << 16, sink, device="cpu")
    with no_sync():
        assert engine.capture("empty", torch.empty(0, 4), step=1)
        assert engine.capture("full", torch.ones(3), step=2)
    time.sleep(0.1)  # the drain looks while they wait
    assert engine.drain_error is None
    engine.close()
    assert [(r.tag, r.shape) for r in sink.records] == [("empty", (0, 4)), ("full", (3,))]
    assert sum(engine.dropped().values()) == 0
