"""What the grant controller does not learn from (late issues, late CLOSEs, grants of an
older pattern version), what it keeps across a redefinition, and how B expires.
"""

from __future__ import annotations

import pytest
from controller_helpers import MiB, evidence, learnt, make

from syncless.capture import Grant, GrantReason, Outcome, WindowPattern


@pytest.mark.parametrize("flag", ["issued_late", "close_late"])
def test_late_issue_and_late_close_are_no_evidence(flag: str) -> None:
    ctl = learnt(make())
    before = evidence(ctl), ctl.budget(0)
    outcome = Outcome(flag)
    # An overrun at or below A would read as a capacity shift (A dropped, B halved) ...
    g = ctl.grant(0, 5, [MiB] * 8)
    assert (
        ctl.complete(g, before_close=False, transfer_s=0.1, window_s=0.001, **{flag: True})
        is outcome
    )
    assert (evidence(ctl), ctl.budget(0)) == before
    # ... a completion before the CLOSE above A would raise A ...
    g = Grant(g.version, 6, 0, 11 * MiB, 11, 11 * MiB, False, g.reason, g.epoch)
    assert (
        ctl.complete(g, before_close=True, transfer_s=1e-3, window_s=1.0, **{flag: True}) is outcome
    )
    assert (evidence(ctl), ctl.budget(0)) == before
    # ... and an overrun between A and B would lower B. None of them may, late.
    g = Grant(g.version, 7, 0, 9 * MiB, 9, 9 * MiB, False, g.reason, g.epoch)
    assert (
        ctl.complete(g, before_close=False, transfer_s=1.0, window_s=1e-3, **{flag: True})
        is outcome
    )
    assert (evidence(ctl), ctl.budget(0)) == before
    assert ctl.counts()[f"completion/{flag}"] == 3


def test_the_same_completions_clean_do_change_learning() -> None:
    # The control for the test above: without the flag each completion is evidence.
    ctl = learnt(make())
    g = ctl.grant(0, 5, [MiB] * 8)
    assert ctl.complete(g, before_close=False, transfer_s=0.1, window_s=0.001) is (
        Outcome.CAPACITY_SHIFT
    )
    assert evidence(ctl) == (None, 8 * MiB, round(8 * MiB / 0.1 * 0.001 * 0.9))
    ctl = learnt(make())
    g = Grant(ctl.version, 6, 0, 11 * MiB, 11, 11 * MiB, False, GrantReason.MIDPOINT, 0)
    assert ctl.complete(g, before_close=True) is Outcome.SAFE
    assert evidence(ctl)[0] == 11 * MiB
    ctl = learnt(make())
    g = Grant(ctl.version, 7, 0, 9 * MiB, 9, 9 * MiB, False, GrantReason.MIDPOINT, 0)
    assert ctl.complete(g, before_close=False) is Outcome.UNSAFE
    assert evidence(ctl)[1] == 9 * MiB


def test_stale_version_completions_are_ignored() -> None:
    ctl = make()
    old = ctl.grant(0, 0, [MiB] * 4)
    assert ctl.define_pattern(WindowPattern(4, [(0, 1), (2, 3)])) == 2
    assert evidence(ctl, 0) == evidence(ctl, 1) == (None, None, None)  # learning restarts
    assert ctl.complete(old, before_close=False) is Outcome.STALE_VERSION
    assert ctl.complete(old, before_close=True) is Outcome.STALE_VERSION
    assert evidence(ctl, 0) == (None, None, None)
    assert ctl.budget(0) == 64 * MiB
    assert ctl.counts()["completion/stale_version"] == 2


def test_redefining_the_same_pattern_keeps_learning() -> None:
    ctl = learnt(make())
    assert ctl.define_pattern(WindowPattern(2, [(0, 1)])) == 1
    assert evidence(ctl) == (8 * MiB, 12 * MiB, 9_000_000)


def test_unsafe_expires() -> None:
    ctl = make(staging=1000, unsafe_expiry=5)
    g = ctl.grant(0, 3, [300])
    ctl.complete(g, before_close=True)
    g = ctl.grant(0, 3, [800])
    ctl.complete(g, before_close=False)  # B = 800, set at occurrence 3
    assert ctl.evidence(0).unsafe_expires_at == 8
    assert ctl.grant(0, 7, [1] * 1000).budget == 550  # midpoint of 300 and 800
    assert ctl.grant(0, 8, [1] * 1000).budget == 300  # B forgotten: only A
    assert evidence(ctl) == (300, None, None)


def test_unsafe_expiry_counts_from_the_last_confirmation() -> None:
    ctl = make(staging=1000, unsafe_expiry=5)
    ctl.complete(ctl.grant(0, 0, [1000]), before_close=False)  # B = 1000 at 0
    ctl.complete(ctl.grant(0, 4, [500]), before_close=False)  # B = 500 at 4
    assert ctl.grant(0, 8, [1] * 1000).budget == 250
    assert ctl.grant(0, 9, [1] * 1000).budget == 1000  # expired at 4 + 5
