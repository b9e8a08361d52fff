"""When two runs part ways: the first step a curve differs, and the first beyond noise.

``syncless compare`` asks it of the loss (each run against the baseline) and of every
per-layer monitor (which layer moved first). Two answers, because two questions:

- **first different**: the first matching step whose values differ beyond float
  rounding. Runs with the same seed and data order agree exactly until a change takes
  effect; this is that step.
- **first beyond noise**: the first step from which the difference is systematic.
  The noise is the difference's own step-to-step scatter, measured where the runs
  differ (a robust scale: 1.4826 x the median absolute change between consecutive
  points, / sqrt 2). The difference is averaged over windows of ``w`` points; the
  first window whose mean exceeds ``k`` x noise / sqrt(w), with the next window beyond
  it on the same side, starts the answer. ``k`` is 3, or more with many windows
  (sqrt(2 ln windows): the largest of that many noise-only means), so a long run of
  pure noise does not raise a false alarm. Runs that differ only by noise (another
  seed, nondeterministic kernels) get a first different step and no step beyond noise.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = ["Divergence", "divergence", "matching"]

#: Relative difference below which two values count as equal (float32 rounding of a
#: loss near 1 is 6e-8; a reduction in another order can move it by a few of those).
RTOL = 1e-6
# Windows: at least this many points each, and about this many windows over a run.
MIN_WINDOW, WINDOWS = 5, 40


class Divergence(NamedTuple):
    """How one curve departs from the baseline's, on their matching steps."""

    first_different: int | None  # the first step the values differ; None: never
    first_beyond_noise: int | None  # the first step of a systematic difference; None: never
    noise: float  # the difference's step-to-step scatter (a standard deviation)
    window: int  # points averaged per window
    last_difference: float  # other - base at the last matching step


def matching(
    base_steps: np.ndarray, base: np.ndarray, steps: np.ndarray, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps both have, base's values there, the other's values there)."""
    common, i, j = np.intersect1d(base_steps, steps, assume_unique=True, return_indices=True)
    return common, base[i], values[j]


def divergence(steps: np.ndarray, base: np.ndarray, other: np.ndarray) -> Divergence:
    """Where ``other`` departs from ``base`` (aligned arrays over the same ``steps``)."""
    n = len(steps)
    if n == 0:
        return Divergence(None, None, math.nan, 0, math.nan)
    d = other - base
    scale = np.maximum(np.maximum(np.abs(base), np.abs(other)), 1e-12)
    both_nan = np.isnan(base) & np.isnan(other)
    differs = ~both_nan & ~(np.abs(d) <= RTOL * scale)  # NaN on one side differs
    if not differs.any():
        return Divergence(None, None, 0.0, 0, float(d[-1]))
    first = int(np.argmax(differs))
    window = max(MIN_WINDOW, n // WINDOWS)
    noise = _scatter(d[first:])
    beyond = _first_window_beyond(d, first, window, noise)
    return Divergence(
        int(steps[first]),
        None if beyond is None else int(steps[beyond]),
        noise,
        window,
        float(d[-1]),
    )


def _scatter(d: np.ndarray) -> float:
    """A robust standard deviation of the step-to-step noise of ``d``."""
    change = np.diff(d[np.isfinite(d)])
    if change.size == 0:
        return 0.0
    return float(1.4826 * np.median(np.abs(change)) / math.sqrt(2))


def _first_window_beyond(d: np.ndarray, first: int, window: int, noise: float) -> int | None:
    """The index that starts the first window (from ``first`` on) whose mean difference
    is beyond the noise, as is the next window's, on the same side."""
    usable = d[first:]
    count = len(usable) // window
    if count == 0:  # fewer points than a window: one short window
        count, window = 1, len(usable)
    means = np.nanmean(usable[: count * window].reshape(count, window), axis=1)
    k = max(3.0, math.sqrt(2 * math.log(count))) if count > 1 else 3.0
    limit = k * noise / math.sqrt(window)
    out = np.abs(means) > limit
    for i in range(count):
        if not out[i]:
            continue
        last = i == count - 1
        if last or (out[i + 1] and np.sign(means[i + 1]) == np.sign(means[i])):
            return first + i * window
    return None
