"""The grant controller against an independent window model.

The model: a window carries ``capacity`` bytes; a copy of ``n`` bytes issued at the OPEN
completes before the CLOSE iff ``n < capacity`` (bandwidth 1 GB/s, so the timings the
engine would report are ``n / 1e9`` and ``capacity / 1e9`` seconds).
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from syncless.capture import (
    ControllerConfig,
    FlushKind,
    Grant,
    GrantController,
    GrantReason,
    Outcome,
    WindowPattern,
)

MiB = 1 << 20
BW = 1e9  # bytes per second in the model
ONE_WINDOW = WindowPattern(2, [(0, 1)])


def make(staging: int = 64 * MiB, pattern: WindowPattern = ONE_WINDOW, **config) -> GrantController:
    ctl = GrantController(staging, ControllerConfig(**config))
    ctl.define_pattern(pattern)
    return ctl


def send(
    ctl: GrantController,
    occurrence: int,
    capacity: float,
    record: int = MiB,
    *,
    position: int = 0,
    **flags,
) -> tuple[Grant, bool]:
    """One window OPEN with plenty of ``record``-sized records ready; returns (grant, overran)."""
    grant = ctl.grant(position, occurrence, itertools.repeat(record))
    overran = grant.records > 0 and grant.nbytes >= capacity
    if grant.records:
        ctl.complete(
            grant,
            before_close=not overran,
            transfer_s=grant.nbytes / BW,
            window_s=capacity / BW,
            **flags,
        )
    return grant, overran


def run(ctl: GrantController, capacities: list[float], record: int, start: int = 0):
    """Occurrences ``start, start+1, ...`` at the given capacities; budgets after each."""
    budgets, overruns, grants = [], [], []
    for i, capacity in enumerate(capacities):
        grant, overran = send(ctl, start + i, capacity, record)
        grants.append(grant.nbytes)
        overruns.append(overran)
        budgets.append(ctl.budget(0))
    return budgets, overruns, grants


def settled_by(budgets: list[int], overruns: list[bool], k: int) -> bool:
    """From occurrence ``k`` on the budget no longer changes and nothing overruns."""
    return all(b == budgets[k] for b in budgets[k:]) and not any(overruns[k + 1 :])


def evidence(ctl: GrantController, position: int = 0) -> tuple:
    e = ctl.evidence(position)
    return e.safe_bytes, e.unsafe_bytes, e.estimate_bytes


# -- grant rules -------------------------------------------------------------------------


def test_no_evidence_grants_everything_transferable() -> None:
    ctl = make(staging=10)
    g = ctl.grant(0, 0, [3, 3, 3, 3])
    assert (g.reason, g.budget, g.records, g.nbytes, g.probe) == (
        GrantReason.NO_EVIDENCE,
        10,
        3,
        9,
        False,
    )
    assert ctl.grant(0, 0, [2, 2]).nbytes == 4  # fewer ready than staging: all of them
    assert ctl.grant(0, 0, []).reason is GrantReason.NOTHING_READY


def test_grants_are_a_prefix_of_whole_records() -> None:
    ctl = make(staging=10)
    # The prefix stops at the first record that does not fit, even if a later one would.
    g = ctl.grant(0, 0, [4, 7, 1])
    assert (g.records, g.nbytes) == (1, 4)
    g = ctl.grant(0, 0, [0, 0, 10, 1])
    assert (g.records, g.nbytes) == (3, 10)


def test_budget_rules() -> None:
    ctl = make(staging=1000)
    g = ctl.grant(0, 0, [800])
    ctl.complete(g, before_close=False)  # only B = 800
    assert ctl.budget(0) == 400
    assert ctl.grant(0, 1, [100] * 10).reason is GrantReason.HALVE
    g = ctl.grant(0, 1, [300])
    ctl.complete(g, before_close=True)  # A = 300, B = 800: midpoint
    assert ctl.budget(0) == 550
    assert ctl.grant(0, 2, [100] * 10).reason is GrantReason.MIDPOINT
    g = ctl.grant(0, 2, [500])
    ctl.complete(g, before_close=False)  # A = 300, B = 500: 200 > 0.25 * 500, midpoint
    assert ctl.budget(0) == 400
    g = ctl.grant(0, 3, [400])
    ctl.complete(g, before_close=True)  # A = 400, B = 500: 100 <= 125, narrow: grant A
    assert ctl.budget(0) == 400
    assert ctl.grant(0, 4, [100] * 10).reason is GrantReason.CONVERGED
    # A copy at or above B that completes before the CLOSE (say, a probe of a 500-byte
    # record) contradicts B: only A is left. E = 500 / 0.5 * 1.0 * 0.9 = 900.
    g = Grant(ctl.version, 4, 0, 400, 1, 500, True, GrantReason.PROBE, epoch=0)
    ctl.complete(g, before_close=True, transfer_s=0.5, window_s=1.0)
    assert evidence(ctl) == (500, None, 900)
    assert (ctl.budget(0), ctl.grant(0, 5, [1] * 2000).reason) == (900, GrantReason.ESTIMATE)
    g = ctl.grant(0, 5, [100] * 9)
    ctl.complete(g, before_close=True, transfer_s=1.0, window_s=1.0)  # E = 810 < A = 900
    assert evidence(ctl) == (900, None, 810)
    assert (ctl.budget(0), ctl.grant(0, 6, [1] * 2000).reason) == (900, GrantReason.SAFE)


def test_estimate_is_a_low_quantile_of_the_latest_clean_capacities() -> None:
    """E against numpy's "lower" quantile of the last ``estimate_history`` capacities
    (bytes / transfer_s * window_s); a capacity shift starts the history over."""
    ctl = make(staging=10**9, estimate_history=10, estimate_quantile=0.2, estimate_margin=1.0)
    rng = random.Random(7)
    capacities = []
    for occurrence in range(25):
        nbytes = rng.randrange(1000, 2000)
        capacities.append(nbytes * 2)  # window twice the transfer
        g = Grant(ctl.version, occurrence, 0, 10**9, 1, nbytes, False, GrantReason.SAFE, epoch=0)
        ctl.complete(g, before_close=True, transfer_s=0.5, window_s=1.0)
        expected = np.quantile(capacities[-10:], 0.2, method="lower")
        assert evidence(ctl)[2] == round(expected), occurrence
    safe = evidence(ctl)[0]
    g = Grant(ctl.version, 25, 0, 10**9, 1, safe, False, GrantReason.SAFE, epoch=0)
    ctl.complete(g, before_close=False, transfer_s=0.5, window_s=0.25)  # overran at A
    assert evidence(ctl) == (None, safe, round(safe / 0.5 * 0.25))


def test_estimate_never_lifts_a_grant_above_staging() -> None:
    ctl = make(staging=1000)
    g = ctl.grant(0, 0, [600])
    ctl.complete(g, before_close=True, transfer_s=1e-6, window_s=1.0)  # E = 5.4e8
    assert ctl.budget(0) == 1000


def test_probe_then_increasing_cooldowns() -> None:
    ctl = make(staging=1000, probe_cooldown_max=4)
    g = ctl.grant(0, 0, [1000])
    ctl.complete(g, before_close=False)  # B = 1000: budget 500
    probes = []
    for occurrence in range(30):
        g = ctl.grant(0, occurrence + 1, [600, 1])
        if g.reason is GrantReason.PROBE:
            # Budget 500 (B = 1000), then 300 once the failed probe set B = 600.
            assert (g.records, g.nbytes, g.probe, g.budget) == (
                1,
                600,
                True,
                300 if probes else 500,
            )
            probes.append(occurrence + 1)
            ctl.complete(g, before_close=False)  # fails every time
        else:
            assert (g.reason, g.records, g.nbytes) == (GrantReason.COOLDOWN, 0, 0)
    # Failed probes f = 1, 2, 3, 4, 5 skip min(2**(f-1), 4) = 1, 2, 4, 4, 4 occurrences.
    assert probes == [1, 3, 6, 11, 16, 21, 26]
    assert ctl.evidence(0).failed_probes == 7
    # A probe that fits resets the back-off and proves the record safe.
    g = ctl.grant(0, 31, [600])
    assert g.probe
    ctl.complete(g, before_close=True)
    e = ctl.evidence(0)
    assert (e.failed_probes, e.probe_allowed_from, e.safe_bytes, e.unsafe_bytes) == (
        0,
        0,
        600,
        None,
    )


def test_probe_failures_reported_late_are_not_counted() -> None:
    ctl = make(staging=1000)
    ctl.complete(ctl.grant(0, 0, [1000]), before_close=False)
    g = ctl.grant(0, 1, [600])
    assert ctl.complete(g, before_close=False, issued_late=True) is Outcome.ISSUED_LATE
    assert ctl.grant(0, 2, [600]).probe  # no cooldown


def test_oversized_record_is_never_granted() -> None:
    ctl = make(staging=100)
    g = ctl.grant(0, 0, [101, 1])
    assert (g.reason, g.records, g.nbytes) == (GrantReason.OVERSIZED, 0, 0)
    with pytest.raises(ValueError, match="no records"):
        ctl.complete(g, before_close=True)


# -- convergence -------------------------------------------------------------------------


def bound(staging: float, capacity: float) -> int:
    return math.ceil(math.log2(staging / capacity)) + 2


@pytest.mark.parametrize(
    ("staging", "capacity", "record"),
    [
        (64 * MiB, 10_000_000, MiB),
        (64 * MiB, 3_000_001, 4096),
        (256 * MiB, 7_777_777, 65536),
        (16 * MiB, 15_000_000, 1024),
        (1 << 30, 1_234_567, 1 << 17),
    ],
)
def test_converges_on_a_static_window(staging: int, capacity: int, record: int) -> None:
    ctl = make(staging)
    budgets, overruns, grants = run(ctl, [capacity] * 40, record)
    k = bound(staging, capacity)
    assert settled_by(budgets, overruns, k), (k, budgets[: k + 3], overruns[: k + 3])
    # Converged means within converged_fraction of the capacity, in whole records.
    assert 0.75 * capacity - record <= grants[-1] < capacity


def test_converges_for_random_windows() -> None:
    rng = random.Random(7)
    for _ in range(40):
        record = rng.choice([1024, 4096, 65536])
        staging = record * rng.randint(64, 4096)
        capacity = rng.uniform(4 * record, 0.99 * staging)
        ctl = make(staging)
        budgets, overruns, _ = run(ctl, [capacity] * 40, record)
        assert settled_by(budgets, overruns, bound(staging, capacity)), (
            staging,
            capacity,
            record,
        )


def test_staging_smaller_than_the_window_is_granted_at_once() -> None:
    ctl = make(staging=4 * MiB)
    budgets, overruns, _ = run(ctl, [10_000_000] * 5, MiB)
    assert budgets == [4 * MiB] * 5 and not any(overruns)


@pytest.mark.parametrize(("before", "after"), [(10_000_000, 2_500_000), (30_000_000, 1_000_000)])
def test_reconverges_after_a_downward_capacity_shift(before: int, after: int) -> None:
    ctl = make(64 * MiB)
    budgets, overruns, grants = run(ctl, [before] * 12, 4096)
    assert settled_by(budgets, overruns, bound(64 * MiB, before))
    settled = grants[-1]
    budgets, overruns, grants = run(ctl, [after] * 30, 4096, start=12)
    assert overruns[0]  # the shift itself shows as an overrun at A ...
    assert ctl.counts()["completion/capacity_shift"] == 1  # ... read as a capacity shift
    # ... and the search restarts from A, halving: same bound with A in place of staging.
    assert settled_by(budgets, overruns, bound(settled, after))
    assert 0.75 * after - 4096 <= grants[-1] < after


def test_upward_shift_is_found_when_unsafe_expires() -> None:
    ctl = make(64 * MiB, unsafe_expiry=8)
    _, _, grants = run(ctl, [10_000_000] * 8, 4096)
    assert grants[-1] < 10_000_000
    _, overruns, grants = run(ctl, [40_000_000] * 30, 4096, start=8)
    # B (at most ~10 MB) expires; then only A is left and E (0.9 * 40 MB) lifts the grant.
    assert grants[-1] >= 0.75 * 40_000_000 - 4096
    assert not any(overruns[-10:])


# -- what is not evidence ----------------------------------------------------------------


def learnt(ctl: GrantController) -> GrantController:
    """Bring ``ctl`` (a 10 MB window, 1 MiB records) to A = 8 MiB, B = 12 MiB, E = 9 MB."""
    run(ctl, [10_000_000] * 5, MiB)
    assert evidence(ctl) == (8 * MiB, 12 * MiB, 9_000_000)
    return ctl


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


# -- suspend, flushes, fallback ----------------------------------------------------------


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


# -- invariants --------------------------------------------------------------------------


def test_grants_never_exceed_staging() -> None:
    """Random engines (deterministic seeds): every grant is a prefix within staging."""
    for seed in range(300):
        rng = random.Random(seed)
        staging = rng.randint(1, 1 << rng.randint(4, 30))
        windows = rng.randint(1, 3)
        ctl = GrantController(
            staging,
            ControllerConfig(
                unsafe_expiry=rng.randint(1, 8),
                converged_fraction=rng.choice([0.0, 0.1, 0.25, 0.5]),
                estimate_margin=rng.choice([0.5, 0.9, 1.0]),
                probe_cooldown_max=rng.randint(1, 4),
                fallback_flushes=rng.randint(1, 6),
                fallback_interval=rng.randint(1, 8),
            ),
        )
        ctl.define_pattern(WindowPattern(windows, [(i, i + 1) for i in range(windows)]))
        outstanding: list[Grant] = []
        occurrence = 0
        for _ in range(60):
            occurrence += rng.randint(0, 2)
            action = rng.random()
            if action < 0.6:
                hi = max(1, int(staging * rng.choice([0.01, 0.3, 1.0, 2.0])))
                ready = [rng.randint(0, hi) for _ in range(rng.randint(0, 12))]
                g = ctl.grant(rng.randrange(windows), occurrence, ready)
                assert g.budget <= staging and g.nbytes <= staging
                assert g.nbytes == sum(ready[: g.records])
                if g.probe:
                    assert g.records == 1 and ready[0] > g.budget
                elif g.records < len(ready) and g.reason not in (
                    GrantReason.COOLDOWN,
                    GrantReason.OVERSIZED,
                ):
                    assert g.nbytes + ready[g.records] > g.budget  # the largest prefix
                if g.records:
                    outstanding.append(g)
            elif action < 0.85 and outstanding:
                g = outstanding.pop(rng.randrange(len(outstanding)))
                ctl.complete(
                    g,
                    before_close=rng.random() < 0.5,
                    issued_late=rng.random() < 0.1,
                    close_late=rng.random() < 0.1,
                    transfer_s=rng.choice([None, rng.uniform(1e-6, 1e-2)]),
                    window_s=rng.uniform(0, 1e-2),
                )
            elif action < 0.9:
                ctl.flush(rng.choice(list(FlushKind)), occurrence)
            elif action < 0.95:
                (ctl.resume if ctl.suspended else ctl.suspend)()
            else:
                ctl.define_pattern(WindowPattern(windows + rng.randint(0, 1), [(0, 1)]))
                windows = len(ctl.pattern)
            for p in range(windows):
                e = ctl.evidence(p)
                assert ctl.budget(p) <= staging
                if e.safe_bytes is not None and e.unsafe_bytes is not None:
                    assert e.safe_bytes < e.unsafe_bytes


# -- errors ------------------------------------------------------------------------------


def test_usage_errors() -> None:
    with pytest.raises(ValueError, match="staging_bytes must be >= 1"):
        GrantController(0)
    with pytest.raises(ValueError, match="staging_bytes must be an integer"):
        GrantController(1.5)
    ctl = GrantController(100)
    with pytest.raises(RuntimeError, match=r"call define_pattern\(WindowPattern"):
        ctl.grant(0, 0, [1])
    ctl.define_pattern(ONE_WINDOW)
    with pytest.raises(ValueError, match=r"window position 1 out of range.*positions 0\.\.0"):
        ctl.grant(1, 0, [1])
    with pytest.raises(ValueError, match="occurrence must be an integer >= 0"):
        ctl.grant(0, -1, [1])
    with pytest.raises(ValueError, match="a ready record size must be an integer >= 0"):
        ctl.grant(0, 0, [-5])
    with pytest.raises(ValueError, match="transfer_s and window_s must be >= 0"):
        ctl.complete(ctl.grant(0, 0, [1]), before_close=True, transfer_s=-1.0, window_s=1.0)


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"unsafe_expiry": 0}, "unsafe_expiry must be an integer >= 1"),
        ({"fallback_flushes": 2.0}, "fallback_flushes must be an integer >= 1"),
        ({"fallback_interval": 0}, "fallback_interval must be an integer >= 1"),
        ({"converged_fraction": 1.0}, "converged_fraction must be in [0, 1)"),
        ({"estimate_margin": 0.0}, "estimate_margin must be in (0, 1]"),
    ],
)
def test_bad_configs_are_rejected(config: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        ControllerConfig(**config)
    assert fragment in str(info.value)


def test_a_probe_that_timing_rules_out_is_not_sent():
    ctl = GrantController(1000)
    ctl.define_pattern(WindowPattern(4, [(0, 1), (2, 3)]))
    # Position 0 measures the bandwidth: 100 bytes in 1 s.
    g = ctl.grant(0, 0, [100])
    ctl.complete(g, before_close=True, transfer_s=1.0, window_s=10.0)
    # Position 1 overruns with 400 bytes: B = 400, so its budget (200) is below the record.
    g = ctl.grant(1, 0, [400])
    assert g.nbytes == 400
    ctl.complete(g, before_close=False)
    # 3 s at 100 B/s carries 300 bytes < 400: skipped; 5 s carries 500: probed.
    g = ctl.grant(1, 1, [400], window_s=3.0)
    assert (g.reason, g.records) == (GrantReason.TOO_SHORT, 0)
    assert ctl.grant(1, 1, [400], window_s=5.0).reason is GrantReason.PROBE
    assert ctl.grant(1, 1, [400]).reason is GrantReason.PROBE  # no duration: probe
    assert ctl.counts()["grant/too_short"] == 1
    with pytest.raises(ValueError, match="window_s"):
        ctl.grant(1, 1, [400], window_s=float("nan"))


def test_without_a_measured_bandwidth_timing_rules_nothing_out():
    ctl = GrantController(1000)
    ctl.define_pattern(WindowPattern(2, [(0, 1)]))
    g = ctl.grant(0, 0, [400])
    ctl.complete(g, before_close=False)  # no timings: no bandwidth
    assert ctl.grant(0, 1, [400], window_s=1e-9).reason is GrantReason.PROBE


def test_budget_is_capped_by_the_windows_short_recent_occurrences() -> None:
    """A window proven to carry 64 MiB in a long occurrence is budgeted, from then on,
    for the short ones it has had lately: 0.9 x the measured bandwidth x the 10%
    quantile of its latest 16 durations (the minimum while there are at most 10)."""
    mib = 1 << 20
    ctl = GrantController(64 * mib)
    ctl.define_pattern(WindowPattern(2, [(0, 1)]))
    ready = [8 * mib] * 8
    g = ctl.grant(0, 0, ready)  # no evidence: all of it
    assert g.nbytes == 64 * mib
    ctl.complete(g, before_close=True, transfer_s=64 * mib / 50e9, window_s=2e-3)
    durations = [0.7e-3, 0.7e-3, 0.45e-3, 0.7e-3, 0.7e-3]
    seen: list[float] = []
    for occurrence, window_s in enumerate(durations, start=1):
        seen.append(window_s)
        g = ctl.grant(0, occurrence, ready, window_s=window_s)
        cap = round(min(seen) * 50e9 * 0.9)  # 31.5e6, then 20.25e6 from the short one on
        assert (g.budget, g.reason) == (cap, GrantReason.SHORT_OCCURRENCES)
        assert g.nbytes == cap // (8 * mib) * 8 * mib  # whole records: 3, then 2
    uncapped = GrantController(64 * mib, ControllerConfig(short_occurrence_cap=False))
    uncapped.define_pattern(WindowPattern(2, [(0, 1)]))
    g = uncapped.grant(0, 0, ready)
    uncapped.complete(g, before_close=True, transfer_s=64 * mib / 50e9, window_s=2e-3)
    assert uncapped.grant(0, 1, ready, window_s=0.45e-3).budget == 64 * mib  # A alone
