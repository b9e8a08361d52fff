"""The window model the grant controller's tests run against, and shortcuts to drive it.

The model: a window carries ``capacity`` bytes; a copy of ``n`` bytes issued at the OPEN
completes before the CLOSE iff ``n < capacity`` (bandwidth 1 GB/s, so the timings the
engine would report are ``n / 1e9`` and ``capacity / 1e9`` seconds).
"""

from __future__ import annotations

import itertools

from syncless.capture import ControllerConfig, Grant, GrantController, WindowPattern

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


def learnt(ctl: GrantController) -> GrantController:
    """Bring ``ctl`` (a 10 MB window, 1 MiB records) to A = 8 MiB, B = 12 MiB, E = 9 MB."""
    run(ctl, [10_000_000] * 5, MiB)
    assert evidence(ctl) == (8 * MiB, 12 * MiB, 9_000_000)
    return ctl
