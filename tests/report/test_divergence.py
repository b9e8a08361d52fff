"""Where two curves part: the first different step and the first beyond noise, on
curves whose parting the test sets."""

from __future__ import annotations

import numpy as np
import pytest

from syncless.report.divergence import divergence, matching

N = 2_000


def curve(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 5 - np.log1p(np.arange(N)) / 2 + rng.normal(0, 0.05, N)


def test_identical_curves_never_differ():
    d = divergence(np.arange(N), curve(0), curve(0).copy())
    assert (d.first_different, d.first_beyond_noise, d.noise) == (None, None, 0.0)


def test_a_shift_is_found_at_the_step_it_starts():
    base = curve(0)
    other = base.copy()
    other[700:] += 0.2  # four times the noise, from step 700 on
    d = divergence(np.arange(N), base, other)
    assert d.first_different == 700 and d.first_beyond_noise == 700
    assert d.last_difference == pytest.approx(0.2)


def test_noise_alone_differs_but_never_beyond_noise():
    base = curve(0)
    other = base.copy()
    other[700:] = curve(1)[700:]  # another seed from step 700: same curve, other noise
    d = divergence(np.arange(N), base, other)
    assert d.first_different == 700 and d.first_beyond_noise is None
    assert d.noise == pytest.approx(0.05 * np.sqrt(2), rel=0.15)  # two runs' noise


def test_another_seed_differs_from_the_start_and_a_drift_is_found_later():
    base, other = curve(0), curve(1)
    other[1_200:] += np.linspace(0, 1, N - 1_200)  # drifts away from step 1,200
    d = divergence(np.arange(N), base, other)
    assert d.first_different == 0
    assert 1_200 <= d.first_beyond_noise <= 1_400  # a window or a few in


def test_a_single_outlier_is_not_a_divergence():
    base = curve(0)
    other = base.copy() + np.random.default_rng(2).normal(0, 0.05, N)
    other[900] += 3.0  # one bad step, then back
    assert divergence(np.arange(N), base, other).first_beyond_noise is None


def test_matching_keeps_the_steps_both_curves_have():
    steps, a, b = matching(np.array([0, 2, 4, 6]), np.array([1.0, 2, 3, 4]),
                           np.array([2, 3, 6]), np.array([20.0, 30, 60]))  # fmt: skip
    assert steps.tolist() == [2, 6] and a.tolist() == [2, 4] and b.tolist() == [20, 60]


def test_a_nan_on_one_side_is_a_difference():
    base = curve(0)
    other = base.copy()
    other[1500] = np.nan
    assert divergence(np.arange(N), base, other).first_different == 1500
