"""Flushes outside the windows and the grant controller's fallback to ordinary batching,
and phases without windows (suspend and resume), in which nothing counts.
"""

from __future__ import annotations

import pytest
from controller_helpers import MiB, evidence, learnt, make

from syncless.capture import FlushKind, GrantReason, Outcome, WindowPattern


def test_fallback_after_repeated_capacity_flushes() -> None:
    ctl = make(fallback_flushes=3, fallback_interval=10)
    assert not ctl.flush(FlushKind.CAPACITY, 2)
    assert not ctl.flush("capacity", 6)
    assert ctl.flush(FlushKind.CAPACITY, 11)  # 2, 6, 11: all within 10 occurrences
    assert ctl.fallback
    assert ctl.fallback_reason is not None
    assert "3 capacity flushes within 10 occurrences" in ctl.fallback_reason
    assert "2, 6, 11" in ctl.fallback_reason
    assert "ordinary batching" in ctl.fallback_reason
    # Terminal: windows are abandoned, grants move everything, completions teach nothing.
    g = ctl.grant(0, 12, [MiB] * 100)
    assert (g.reason, g.nbytes) == (GrantReason.FALLBACK, 64 * MiB)
    assert ctl.complete(g, before_close=False) is Outcome.FALLBACK
    ctl.define_pattern(WindowPattern(3, [(1, 2)]))
    assert ctl.fallback


def test_isolated_capacity_flushes_age_out() -> None:
    ctl = make(fallback_flushes=3, fallback_interval=10)
    for occurrence in range(0, 200, 5):  # never three within 10 occurrences
        assert not ctl.flush(FlushKind.CAPACITY, occurrence)
    assert ctl.counts()["flush/capacity"] == 40
    # Only the flushes of the last 10 occurrences count: at 20 those are 11 and 20.
    ctl = make(fallback_flushes=3, fallback_interval=10)
    for occurrence in (0, 1, 10, 11, 20):
        assert not ctl.flush(FlushKind.CAPACITY, occurrence)
    assert ctl.flush(FlushKind.CAPACITY, 20)
    assert "(at occurrences 11, 20, 20)" in ctl.fallback_reason


def test_lifecycle_and_oversized_flushes_never_count() -> None:
    ctl = make(fallback_flushes=2, fallback_interval=100)
    for occurrence in range(50):
        ctl.flush(FlushKind.LIFECYCLE, occurrence)
        ctl.flush(FlushKind.OVERSIZED, occurrence)
    assert not ctl.fallback
    assert not ctl.flush(FlushKind.CAPACITY, 50)  # and they did not prime it either
    with pytest.raises(ValueError, match="expected one of capacity, lifecycle, oversized"):
        ctl.flush("drop", 51)


def test_evaluation_phase_causes_no_fallback() -> None:
    ctl = learnt(make(fallback_flushes=3, fallback_interval=16))
    before = evidence(ctl)
    in_flight = ctl.grant(0, 5, [MiB] * 8)
    ctl.suspend()
    assert ctl.suspended
    for occurrence in range(5, 15):  # evaluation: no windows, the ring fills every time
        g = ctl.grant(0, occurrence, [MiB] * 100)
        assert (g.reason, g.nbytes) == (GrantReason.SUSPENDED, 64 * MiB)
        assert ctl.complete(g, before_close=False) is Outcome.SUSPENDED
        ctl.flush(FlushKind.CAPACITY, occurrence)
    assert ctl.complete(in_flight, before_close=False) is Outcome.SUSPENDED
    ctl.resume()
    assert not ctl.fallback
    assert ctl.counts()["flush/capacity_not_counted"] == 10
    assert evidence(ctl) == before
    # A grant made before the suspend and reported after the resume straddled it.
    assert ctl.complete(in_flight, before_close=False) is Outcome.INTERRUPTED
    assert evidence(ctl) == before
    # The same flushes while training do trigger the fallback.
    for occurrence in range(15, 18):
        ctl.flush(FlushKind.CAPACITY, occurrence)
    assert ctl.fallback


def test_suspend_resume_pairing() -> None:
    ctl = make()
    with pytest.raises(RuntimeError, match="call suspend"):
        ctl.resume()
    ctl.suspend()
    with pytest.raises(RuntimeError, match="pair each suspend"):
        ctl.suspend()
