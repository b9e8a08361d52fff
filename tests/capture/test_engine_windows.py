"""The pattern-driven drain on the CPU: the engine copies what the controller grants, at
the window OPEN, and reports what the boundary and copy stamps measured.

Engines, clock and scripted controller are in ``engine_window_helpers``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from engine_window_helpers import ONE_WINDOW, Clock, ScriptedController, engine_for, floats

from syncless.capture import CaptureEngine, GrantController, MemorySink, WindowPattern
from syncless.guard import no_sync


def test_grants_are_respected_whole_records_never_more_than_granted() -> None:
    clock = Clock()
    sink = MemorySink()
    ctl = GrantController(4096)
    engine = engine_for(ctl, clock=clock, sink=sink)
    engine.define_pattern(ONE_WINDOW)
    gen = torch.Generator().manual_seed(1)
    truth = []
    for occ in range(30):
        for _ in range(int(torch.randint(2, 9, (), generator=gen))):
            x = torch.randn(int(torch.randint(1, 300, (), generator=gen)), generator=gen)
            truth.append(x.clone())
            assert engine.capture("x", x, step=occ)
        before = engine.counters()["d2h_bytes"]
        engine.poll()  # in the critical region: nothing may move
        assert engine.counters()["d2h_bytes"] == before
        engine.advance_boundary()  # OPEN
        engine.poll()
        moved = engine.counters()["d2h_bytes"] - before
        clock.t += 0.0 if occ % 4 == 1 else 1.0  # a zero-length window overruns
        engine.advance_boundary()  # CLOSE
        engine.poll()
        report = engine.window_reports()[-1]
        assert report.occurrence == occ
        assert moved == report.moved_bytes == report.granted_bytes
        # Within the budget, or a probe: the first record alone, larger than the budget.
        assert report.granted_bytes <= report.budget <= 4096 or (
            report.probe and report.granted_records == 1
        )
        assert report.before_close == (occ % 4 != 1)
    c = engine.counters()
    assert c["d2h_batch_bytes"] == c["d2h_flush_bytes"] == 0  # only windows so far
    assert c["d2h_window_bytes"] == sum(r.moved_bytes for r in engine.window_reports())
    assert c["window_transfers_count"] == 30 and c["window_overruns_count"] == 8
    evidence = ctl.evidence(0)
    assert evidence.safe_bytes is not None and evidence.unsafe_bytes is not None
    engine.close()
    got = [r.tensor() for r in sink.records]
    assert len(got) == len(truth) and all(
        torch.equal(a, b) for a, b in zip(got, truth, strict=True)
    )


def test_the_engine_copies_exactly_the_granted_prefix() -> None:
    sizes = [64, 128, 64, 256, 64, 192, 64, 64, 128, 64]  # bytes; spans at align 64
    ctl = ScriptedController(4096, [3, 0, 4, 10])
    sink = MemorySink()
    engine = engine_for(ctl, sink=sink)
    engine.define_pattern(ONE_WINDOW)
    for i, n in enumerate(sizes):
        engine.capture(f"r{i}", floats(n // 4, i))
    stored = []
    for _ in range(4):
        engine.advance_boundary()
        engine.poll()
        engine.advance_boundary()
        engine.poll()
        stored.append(engine.counters()["d2h_window_bytes"])
    assert ctl.offered[0] == sizes  # every ready record, in order, whole
    assert ctl.offered[1] == sizes[3:]
    assert ctl.offered[2] == sizes[3:]
    assert ctl.offered[3] == sizes[7:]
    assert stored == [256, 256, 256 + 576, 256 + 576 + 256]
    assert [r.granted_records for r in engine.window_reports()] == [3, 4, 3]
    engine.close()
    assert [r.tag for r in sink.records] == [f"r{i}" for i in range(10)]


def test_window_measurements_come_from_the_boundary_and_copy_stamps() -> None:
    clock = Clock()
    ctl = ScriptedController(4096, [1, 1, 1])
    engine = engine_for(ctl, clock=clock, late_issue_s=0.5)
    engine.define_pattern(ONE_WINDOW)

    def window(open_t: float, issue_t: float, close_t: float) -> dict[str, Any]:
        engine.capture("x", floats(16, 1.0))
        clock.t = open_t
        engine.advance_boundary()
        clock.t = issue_t
        engine.poll()  # the copy starts and ends at issue_t (a CPU copy is synchronous)
        clock.t = close_t
        engine.advance_boundary()
        engine.poll()
        return ctl.completions[-1]

    ok = window(10.0, 10.25, 12.0)
    assert (ok["before_close"], ok["issued_late"], ok["close_late"]) == (True, False, False)
    assert ok["transfer_s"] == 0.0 and ok["window_s"] == 2.0
    late = window(20.0, 21.0, 22.0)  # issued 1 s after the OPEN: more than late_issue_s
    assert (late["before_close"], late["issued_late"]) == (True, True)
    over = window(30.0, 31.0, 31.0)  # the copy ends at the CLOSE: an overrun
    assert over["before_close"] is False
    assert [r.outcome for r in engine.window_reports()] == ["safe", "issued_late", "issued_late"]
    engine.close()


def test_a_grant_gets_the_window_duration_of_the_previous_occurrence() -> None:
    clock = Clock()
    ctl = ScriptedController(4096, [0, 0, 0])
    engine = engine_for(ctl, clock=clock)
    engine.define_pattern(ONE_WINDOW)
    engine.capture("x", floats(16, 1.0))  # ready in every window: each one is granted
    for open_t, close_t in ((10.0, 12.0), (20.0, 20.5), (30.0, 31.0)):
        clock.t = open_t
        engine.advance_boundary()
        engine.poll()
        clock.t = close_t
        engine.advance_boundary()
        engine.poll()
    # Occurrence 0 has no previous one; 1 and 2 get the durations of 0 and 1.
    assert ctl.last_durations == [None, 2.0, 0.5]
    engine.close()


def test_lost_close_stamp_is_close_late_and_unseen_windows_are_missed() -> None:
    ctl = ScriptedController(4096, [1, 1])
    engine = engine_for(ctl, boundary_pool=2)
    engine.define_pattern(ONE_WINDOW)
    engine.capture("x", floats(16, 1.0))
    engine.advance_boundary()  # OPEN of occurrence 0
    engine.poll()  # issued
    for _ in range(3):  # CLOSE 0, OPEN 1, CLOSE 1: the drain does not look meanwhile
        engine.advance_boundary()
    engine.poll()
    (done,) = ctl.completions
    assert done["close_late"] is True  # boundary 1's stamp slot now holds boundary 3's
    assert engine.counters()["window_missed_count"] == 1  # occurrence 1 came and went
    assert ctl.evidence(0).safe_bytes is None  # no evidence either way
    engine.close()


def test_completion_under_an_older_pattern_is_stale() -> None:
    ctl = GrantController(4096)
    engine = engine_for(ctl)
    v1 = engine.define_pattern(ONE_WINDOW)
    assert engine.define_pattern(WindowPattern(2, [(0, 1)])) == v1  # unchanged: same version
    engine.capture("x", floats(16, 1.0))
    engine.advance_boundary()
    engine.poll()
    v2 = engine.define_pattern(WindowPattern(3, [(0, 2)]))
    assert v2 == v1 + 1
    engine.poll()
    assert [r.outcome for r in engine.window_reports()] == ["stale_version"]
    # The new pattern counts boundaries from 0: boundary 0 OPENs its window.
    engine.capture("y", floats(16, 2.0))
    engine.advance_boundary()
    engine.poll()
    assert engine.counters()["window_grants_count"] == 2
    engine.close()


def test_oversized_record_goes_first_then_the_window_gets_its_grant() -> None:
    ctl = GrantController(1024)
    sink = MemorySink()
    engine = engine_for(ctl, ring=8192, staging=1024, sink=sink)
    engine.define_pattern(ONE_WINDOW)
    engine.capture("big", floats(512, 7.0))  # 2 KiB > staging
    engine.capture("small", floats(16, 1.0))
    engine.advance_boundary()
    engine.poll()
    assert ctl.counts()["flush/oversized"] == 1
    engine.advance_boundary()
    engine.poll()
    (report,) = engine.window_reports()
    assert report.granted_records == 1 and report.moved_bytes == 64
    c = engine.counters()
    assert c["d2h_oversized_bytes"] == 2048 and c["flush_oversized_count"] == 1
    engine.close()
    assert [r.tag for r in sink.records] == ["big", "small"]


def test_two_window_positions_and_critical_phases() -> None:
    clock = Clock()
    ctl = GrantController(4096)
    engine = engine_for(ctl, clock=clock)
    engine.define_pattern(WindowPattern(4, [(0, 1), (2, 3)]))
    for occ in range(3):
        for phase in range(4):
            engine.capture("x", floats(16, phase))
            before = engine.counters()["d2h_bytes"]
            engine.advance_boundary()
            engine.poll()
            clock.t += 1.0
            moved = engine.counters()["d2h_bytes"] - before
            assert (moved > 0) == (phase in (0, 2)), (occ, phase)
    reports = engine.window_reports()
    assert [(r.occurrence, r.position) for r in reports] == [
        (o, p) for o in range(3) for p in (0, 1)
    ]
    assert all(r.before_close for r in reports)
    engine.close()


def test_boundaries_and_captures_in_hooks_under_no_sync_with_a_background_drain() -> None:
    sink = MemorySink()
    engine = CaptureEngine(1 << 16, 1 << 12, sink, device="cpu")
    engine.define_pattern(ONE_WINDOW)
    truth = []
    with no_sync(cpu_as_device=True):
        for step in range(20):
            x = torch.full((8,), float(step))
            truth.append(x.clone())
            engine.capture("x", x, step=step)
            engine.advance_boundary()  # OPEN
            time.sleep(0.002)  # the window: the drain thread polls every 0.2 ms
            engine.advance_boundary()  # CLOSE
    engine.close()
    assert [r.step for r in sink.records] == list(range(20))
    assert all(torch.equal(r.tensor(), t) for r, t in zip(sink.records, truth, strict=True))
    c = engine.counters()
    assert c["d2h_window_bytes"] > 0 and c["d2h_batch_bytes"] == 0
    assert c["window_grants_count"] + c["window_missed_count"] == 20
