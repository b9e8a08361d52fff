"""The grant controller's grant rules (whole-record prefixes, the budget rules, probes and
their cooldown), its invariants, and its usage errors; the window model and the helpers
are in ``controller_helpers``.
"""

from __future__ import annotations

import random

import pytest
from controller_helpers import ONE_WINDOW, evidence, make

from syncless.capture import (
    ControllerConfig,
    FlushKind,
    Grant,
    GrantController,
    GrantReason,
    Outcome,
    WindowPattern,
)

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
