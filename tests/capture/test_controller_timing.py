"""What device timings add to the grant controller: E (a low quantile of the measured
capacities), the cap for a window's short recent occurrences, and probes that timing
rules out (``too_short``).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from controller_helpers import evidence, make

from syncless.capture import ControllerConfig, Grant, GrantController, GrantReason, WindowPattern


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
