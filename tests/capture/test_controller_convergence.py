"""The grant controller converges on a window's capacity, and again after the capacity
shifts: in the window model of ``controller_helpers`` the budget settles, without
overruns, within ``bound()`` occurrences.
"""

from __future__ import annotations

import math
import random

import pytest
from controller_helpers import MiB, make, run, settled_by


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
