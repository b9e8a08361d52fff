"""Planned windows (``EngineConfig(planned_windows=True)``): the drain decides a window's
copy ahead, while the critical region runs, and ``advance_boundary()`` launches it at
the OPEN; plans that no longer hold are dropped.

Engines, clock and scripted controller are in ``engine_window_helpers``.
"""

from __future__ import annotations

import time

import torch
from engine_window_helpers import ONE_WINDOW, Clock, ScriptedController, planned_engine

from syncless.capture import CaptureEngine, EngineConfig, MemorySink, WindowPattern
from syncless.guard import no_sync


def test_planned_windows_are_taken_in_order_from_the_first_unpublished_open() -> None:
    from syncless.capture.drain.windows import _windows_from

    pattern = WindowPattern(6, [(1, 2), (3, 5)])  # OPENs at 1 and 3 of every 6
    # (occurrence, position, open boundary, close boundary), one period's worth.
    assert _windows_from(pattern, 0) == [(0, 0, 1, 2), (0, 1, 3, 5)]
    assert _windows_from(pattern, 2) == [(0, 1, 3, 5), (1, 0, 7, 8)]
    assert _windows_from(pattern, 3) == [(0, 1, 3, 5), (1, 0, 7, 8)]
    assert _windows_from(pattern, 4) == [(1, 0, 7, 8), (1, 1, 9, 11)]
    assert _windows_from(pattern, 13) == [(2, 0, 13, 14), (2, 1, 15, 17)]
    assert _windows_from(pattern, 14) == [(2, 1, 15, 17), (3, 0, 19, 20)]


def test_a_planned_copy_moves_at_its_window_open_and_not_before() -> None:
    """The drain plans while the critical region runs; advance_boundary() copies at the
    OPEN (on the CPU the launch is the copy itself)."""
    clock = Clock()
    engine, sink = planned_engine(clock=clock)
    engine.define_pattern(ONE_WINDOW)
    truth = []
    for occ in range(6):
        x = torch.full((64,), float(occ))
        truth.append(x.clone())
        with no_sync(cpu_as_device=True):
            engine.capture("x", x, step=occ)
        engine.poll()  # plans the next window; nothing moves in the critical region
        engine.poll()
        c = engine.counters()
        assert c["window_launched_count"] == occ and c["d2h_window_bytes"] == 256 * occ
        clock.t += 1.0
        with no_sync(cpu_as_device=True):
            engine.advance_boundary()  # OPEN: the planned copy is launched here
        assert engine.counters()["window_launched_count"] == occ + 1
        clock.t += 1.0
        engine.advance_boundary()  # CLOSE
        engine.poll()
        assert engine.counters()["d2h_window_bytes"] == 256 * (occ + 1)
    c = engine.counters()
    assert c["window_planned_count"] == c["window_launched_count"] == 6
    assert c["window_plan_dropped_count"] == 0 and c["window_missed_count"] == 0
    reports = engine.window_reports()
    assert [r.occurrence for r in reports] == list(range(6))
    assert all(r.before_close and not r.issued_late for r in reports)
    assert all(r.window_s == 1.0 and r.transfer_s == 0.0 for r in reports)
    engine.close()
    got = [r.tensor() for r in sink.records]
    assert all(torch.equal(a, b) for a, b in zip(got, truth, strict=True))


def test_a_flush_drops_the_plan_and_takes_its_records_once() -> None:
    engine, sink = planned_engine()
    engine.define_pattern(ONE_WINDOW)
    xs = [torch.full((16,), float(i)) for i in range(3)]
    with no_sync(cpu_as_device=True):
        for x in xs:
            engine.capture("x", x)
    engine.poll()
    assert engine.counters()["window_planned_count"] == 1
    engine.flush()  # a lifecycle request: the plan's records go by the flush
    c = engine.counters()
    assert c["window_plan_dropped_count"] == 1
    assert c["d2h_flush_bytes"] == 3 * 64 and c["d2h_window_bytes"] == 0
    with no_sync(cpu_as_device=True):
        engine.advance_boundary()  # the OPEN the plan was for: nothing left to launch
    assert engine.counters()["window_launched_count"] == 0
    engine.close()
    got = [r.tensor() for r in sink.records]
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, xs, strict=True))


def test_a_plan_for_an_old_pattern_is_dropped_and_suspend_batches() -> None:
    engine, sink = planned_engine()
    engine.define_pattern(ONE_WINDOW)
    with no_sync(cpu_as_device=True):
        engine.capture("a", torch.ones(16))
    engine.poll()
    engine.define_pattern(WindowPattern(4, [(1, 2)]))  # a new version before the OPEN
    with no_sync(cpu_as_device=True):
        engine.advance_boundary()  # boundary 0 of the new pattern: not the plan's
    engine.poll()
    c = engine.counters()
    assert c["window_plan_dropped_count"] == 1 and c["window_launched_count"] == 0
    engine.poll()  # plans again, for the new pattern's window at boundary 1
    engine.suspend()
    engine.poll()  # suspended: the plan is dropped and batching takes the record
    c = engine.counters()
    assert c["window_plan_dropped_count"] == 2 and c["d2h_batch_bytes"] == 64
    engine.resume()
    engine.close()
    assert len(sink.records) == 1 and torch.equal(sink.records[0].tensor(), torch.ones(16))


def test_planned_windows_with_a_drain_thread_store_every_record_once() -> None:
    """The launch runs on this thread while the drain thread plans: every record is
    stored exactly once and in order, whatever the interleaving. (Without the plan lock
    held through the launch, the drain planned the same records again: this test failed
    3 times in 3.)"""
    sink = MemorySink()
    engine = CaptureEngine(
        1 << 16, 1 << 12, sink, device="cpu", background=True,
        config=EngineConfig(planned_windows=True, poll_interval_s=1e-5),
    )  # fmt: skip
    engine.define_pattern(WindowPattern(4, [(1, 2), (3, 4)]))
    truth = []
    gen = torch.Generator().manual_seed(3)
    for step in range(300):
        x = torch.randn(int(torch.randint(1, 64, (), generator=gen)), generator=gen)
        truth.append(x.clone())
        # block: a slow drain (a busy CI machine) makes captures wait, never drop; the
        # wait is a request that drops the plan, which this test wants to race too.
        with no_sync(cpu_as_device=True):
            engine.capture("x", x, step=step, on_full="block")
        for _ in range(4):
            with no_sync(cpu_as_device=True):
                engine.advance_boundary()
            if step % 7 == 0:
                time.sleep(1e-4)  # let the drain thread plan between boundaries
    engine.close()
    got = [r.tensor() for r in sink.records]
    assert [r.step for r in sink.records] == list(range(300))
    assert all(torch.equal(a, b) for a, b in zip(got, truth, strict=True))
    c = engine.counters()
    assert c["window_launched_count"] > 0
    assert c["stored_count"] == 300 and c["dropped_ring_full_count"] == 0


def test_a_period_that_grants_nothing_is_decided_again_only_once_it_has_opened() -> None:
    """No window of the next period takes the ready record: the drain asks the
    controller again only after the last of those OPENs is published, however often it
    looks before (it used to ask once per look, a period further ahead each time)."""
    controller = ScriptedController(1 << 12, [0, 1])
    engine, sink = planned_engine(controller)
    engine.define_pattern(ONE_WINDOW)  # OPENs at boundaries 0, 2, 4, ...
    x = torch.arange(16, dtype=torch.float32)
    with no_sync(cpu_as_device=True):
        engine.capture("x", x)
    for _ in range(5):
        engine.poll()
    assert len(controller.offered) == 1  # the window at boundary 0 granted nothing
    assert engine.counters()["window_planned_count"] == 0
    with no_sync(cpu_as_device=True):
        engine.advance_boundary()  # boundary 0: that window opened
    engine.poll()
    assert len(controller.offered) == 2  # now the window at boundary 2, which grants it
    assert engine.counters()["window_planned_count"] == 1
    with no_sync(cpu_as_device=True):
        engine.advance_boundary()  # 1: CLOSE
        engine.advance_boundary()  # 2: OPEN, the planned copy goes
    engine.poll()
    c = engine.counters()
    assert c["window_launched_count"] == 1 and c["d2h_window_bytes"] == 64
    engine.close()
    assert len(sink.records) == 1 and torch.equal(sink.records[0].tensor(), x)
