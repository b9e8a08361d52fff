"""Draining outside the windows: the batching of a suspended phase, capacity flushes and
the fallback to batching they cause, and waits on a full ring (``on_full``).

Engines, clock and scripted controller are in ``engine_window_helpers``.
"""

from __future__ import annotations

import threading

import pytest
from engine_window_helpers import ONE_WINDOW, engine_for, floats

from syncless.capture import CaptureEngine, ControllerConfig, GrantController, MemorySink


def test_suspended_phase_batches_and_counts_nothing_against_the_windows() -> None:
    ctl = GrantController(1024, ControllerConfig(fallback_flushes=1))
    sink = MemorySink()
    engine = engine_for(ctl, ring=1024, staging=1024, sink=sink)
    engine.define_pattern(ONE_WINDOW)
    engine.capture("a", floats(16, 1.0))
    engine.advance_boundary()
    engine.poll()  # a window transfer in flight across the suspend
    engine.suspend()
    engine.poll()
    assert [r.outcome for r in engine.window_reports()] == ["suspended"]
    for i in range(40):  # evaluation, no boundaries: 40 x 64 B overflow the 1 KiB ring
        assert engine.capture("eval", floats(16, i), on_full="flush")
    c = engine.counters()
    assert c["flush_capacity_count"] == 2 and c["d2h_flush_bytes"] == 32 * 64
    assert ctl.counts()["flush/capacity_not_counted"] == 2
    assert not ctl.fallback
    engine.poll()  # the last 8 go by ordinary batching
    assert engine.counters()["d2h_batch_bytes"] == 8 * 64
    engine.resume()
    engine.close()
    assert len(sink.records) == 41


def test_repeated_capacity_flushes_fall_back_to_batching() -> None:
    ctl = GrantController(256, ControllerConfig(fallback_flushes=2, fallback_interval=16))
    sink = MemorySink()
    engine = engine_for(ctl, ring=256, staging=256, sink=sink)
    engine.define_pattern(ONE_WINDOW)
    for i in range(9):  # 4 fit; the 5th and the 9th flush the ring outside any window
        assert engine.capture("x", floats(16, i), on_full="flush")
    assert ctl.fallback and engine.counters()["fallback"] == 1
    assert engine.counters()["flush_capacity_count"] == 2
    before = engine.counters()["d2h_batch_bytes"]
    engine.poll()  # no window needed any more
    assert engine.counters()["d2h_batch_bytes"] > before
    engine.close()
    assert [r.tensor()[0].item() for r in sink.records] == list(range(9))


def test_block_under_windows_frees_just_enough_and_flush_frees_everything() -> None:
    no_fallback = ControllerConfig(fallback_flushes=100)

    def run(policy: str) -> CaptureEngine:
        engine = engine_for(GrantController(256, no_fallback), ring=256, staging=256)
        engine.define_pattern(ONE_WINDOW)  # no boundary ever comes: only waits drain
        for i in range(10):
            assert engine.capture("x", floats(16, i), on_full=policy)  # type: ignore[arg-type]
        engine.close()
        return engine

    block, flush = run("block"), run("flush")
    assert block.counters()["blocked_count"] == 6  # one record freed per wait: 5th..10th
    assert flush.counters()["blocked_count"] == 2  # the whole ring per wait: 5th, 9th
    for engine in (block, flush):
        assert [r.tensor()[0].item() for r in engine.sink.records] == list(range(10))  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy", ["block", "flush"])
def test_background_waits_store_every_record(policy: str) -> None:
    sink = MemorySink()
    engine = CaptureEngine(1024, 512, sink, device="cpu", on_full=policy)  # type: ignore[arg-type]
    threads = [
        threading.Thread(
            target=lambda k=k: [engine.capture(f"t{k}", floats(16, i), step=i) for i in range(150)]
        )
        for k in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.close()
    assert sum(engine.dropped().values()) == 0
    for k in range(2):
        got = [r.tensor()[0].item() for r in sink.records if r.tag == f"t{k}"]
        assert got == list(range(150))  # each thread's records, in its order
