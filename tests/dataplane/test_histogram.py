"""LogHistogram against numpy ground truth: quantile error, merge exactness, gates, layout."""

from __future__ import annotations

import math

import numpy as np
import pytest

from syncless.dataplane.histogram import LogHistogram, min_samples_for

ALPHA = 0.01
# Float rounding in log/ceil can put a value a hair over a bucket edge: allow 1e-9.
TOL = ALPHA * (1 + 1e-9)


def _lognormal(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(mean=0.0, sigma=1.0, size=n)  # ms, ~1 ms


@pytest.fixture(scope="module")
def samples() -> np.ndarray:
    return _lognormal(100_000)


def test_quantiles_within_relative_error(samples: np.ndarray) -> None:
    h = LogHistogram(alpha=ALPHA)
    h.record_many(samples)
    qs = [0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999]
    truth = np.quantile(samples, qs, method="lower")  # the k-th smallest, k = floor(q(n-1))
    for q, est, exact in zip(qs, h.quantiles(qs), truth, strict=True):
        assert est is not None
        assert abs(est - exact) <= TOL * exact, (q, est, exact)
    # Against numpy's default (interpolated) definition the error stays near alpha too.
    for q in (0.5, 0.9, 0.99):
        exact = float(np.quantile(samples, q))
        assert abs(h.quantile(q) - exact) <= 1.05 * ALPHA * exact


def test_record_matches_record_many(samples: np.ndarray) -> None:
    part = samples[:20_000]
    a, b = LogHistogram(), LogHistogram()
    for x in part.tolist():
        a.record(x)
    b.record_many(part)
    assert np.array_equal(a.counts, b.counts)
    assert a.count == b.count == part.size
    assert a.min == b.min == part.min() and a.max == b.max == part.max()
    assert math.isclose(a.sum, float(part.sum()), rel_tol=1e-12)
    assert math.isclose(b.sum, float(part.sum()), rel_tol=1e-12)
    assert a.mean is not None and math.isclose(a.mean, float(part.mean()), rel_tol=1e-12)


def test_every_bucket_estimate_within_alpha() -> None:
    # One value per bucket edge neighbourhood across the whole range.
    xs = np.geomspace(0.01, 60_000.0, 20_000)
    for x in xs[::97].tolist():
        h = LogHistogram()
        h.record(x)
        h.record(x)  # two samples so that q=0.5 is a bucket estimate, not q=0/1
        # A single-valued histogram clamps to the exact value: look at the raw bucket.
        slot = int(np.flatnonzero(h.counts)[0])
        est = h._slot_value(slot)
        assert abs(est - x) <= TOL * x, (x, est)


def test_quantile_clamped_to_exact_extremes() -> None:
    h = LogHistogram()
    vals = [1.234, 1.235, 1.2351]
    for v in vals:
        h.record(v)
    assert h.quantile(0.0) == min(vals)
    assert h.quantile(1.0) == max(vals)
    for q in (0.01, 0.5, 0.99):
        est = h.quantile(q)
        assert est is not None and min(vals) <= est <= max(vals)
    single = LogHistogram()
    single.record(7.77)
    assert [single.quantile(q) for q in (0, 0.5, 0.99, 1)] == [7.77] * 4


def test_empty() -> None:
    h = LogHistogram()
    assert h.count == 0 and h.min is None and h.max is None and h.mean is None
    assert h.quantile(0.5) is None
    assert h.percentiles_gated() == {}
    with pytest.raises(ValueError):
        h.quantile(1.5)


def test_underflow_overflow_and_nan() -> None:
    h = LogHistogram(min_value=0.01, max_value=60_000.0)
    for v in (0.0, -1.0, 0.001, 0.009999):
        h.record(v)
    for v in (60_001.0, 1e9, math.inf):
        h.record(v)
    h.record(float("nan"))
    h.record(5.0)
    assert h.underflow == 4 and h.overflow == 3 and h.nan_count == 1
    assert h.count == 8  # NaN not counted
    assert int(h.counts.sum()) == 8
    assert h.min == -1.0 and h.max == math.inf
    # q in the underflow bucket: reported as "at most min_value".
    assert h.quantile(0.2) == 0.01
    # q in the overflow bucket: the exact maximum.
    assert h.quantile(0.95) == math.inf
    # Exact range ends go to the regular buckets.
    e = LogHistogram()
    e.record(0.01)
    e.record(60_000.0)
    assert e.underflow == 0 and e.overflow == 0 and int(e.counts.sum()) == 2
    # Overflow reported as the exact maximum (finite case), underflow clamped to the range.
    o = LogHistogram(max_value=100.0)
    o.record_many(np.array([150.0, 170.0, 190.0]))
    assert o.quantile(0.5) == 190.0
    u = LogHistogram(min_value=1.0)
    u.record_many(np.array([0.1, 0.2, 0.3, np.nan]))
    assert u.quantile(0.5) == 0.3 and u.nan_count == 1  # clamped to the exact max


def test_merge_four_ranks_equals_union(samples: np.ndarray) -> None:
    parts = np.array_split(samples[:40_000], 4)
    parts[2] = np.concatenate([parts[2], [0.0001, 1e6]])  # under/overflow on one rank
    ranks = []
    for p in parts:
        h = LogHistogram()
        for x in p.tolist():
            h.record(x)
        ranks.append(h)
    union_values = np.concatenate(parts)
    union = LogHistogram()
    for x in union_values.tolist():
        union.record(x)
    merged = ranks[0].copy()
    for h in ranks[1:]:
        merged.merge(h)
    assert np.array_equal(merged.counts, union.counts)
    assert merged.count == union.count and merged.min == union.min and merged.max == union.max
    assert math.isclose(merged.sum, union.sum, rel_tol=1e-12)
    qs = [0.0, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0]
    assert merged.quantiles(qs) == union.quantiles(qs)
    assert ranks[0].count == parts[0].size  # copy() left rank 0 untouched

    # The same merge through the cross-rank arrays (SUM over to_array, MAX over max_array).
    sums = np.sum([h.to_array() for h in ranks], axis=0)
    maxes = np.max([h.max_array() for h in ranks], axis=0)
    via_arrays = LogHistogram.from_array(sums, maxes)
    assert np.array_equal(via_arrays.counts, union.counts)
    assert via_arrays.min == union.min and via_arrays.max == union.max
    assert via_arrays.quantiles(qs) == union.quantiles(qs)


def test_merge_requires_same_params() -> None:
    a = LogHistogram()
    with pytest.raises(ValueError, match="different layouts"):
        a.merge(LogHistogram(alpha=0.02))
    with pytest.raises(ValueError, match="different layouts"):
        a.merge(LogHistogram(max_value=1000.0))
    with pytest.raises(TypeError):
        a.merge([1, 2])  # type: ignore[arg-type]


def test_array_round_trip() -> None:
    h = LogHistogram(alpha=0.02, min_value=0.1, max_value=1000.0)
    h.record_many(np.array([0.05, 0.5, 3.0, 3.0, 2000.0, np.nan]))
    s, m = h.to_array(), h.max_array()
    assert s.dtype == np.float64 and s.shape == (h.array_size,)
    assert list(m) == [2000.0, -0.05]
    back = LogHistogram.from_array(s, m, alpha=0.02, min_value=0.1, max_value=1000.0)
    assert np.array_equal(back.counts, h.counts)
    assert (back.count, back.sum, back.min, back.max, back.nan_count) == (
        h.count,
        h.sum,
        h.min,
        h.max,
        h.nan_count,
    )
    assert back.quantiles([0.1, 0.5, 0.9]) == h.quantiles([0.1, 0.5, 0.9])
    empty = LogHistogram()
    e = LogHistogram.from_array(empty.to_array(), empty.max_array())
    assert e.count == 0 and e.min is None and e.max is None
    with pytest.raises(ValueError, match="layout"):
        LogHistogram.from_array(s, m)  # default params: a different layout


def test_gates() -> None:
    assert [min_samples_for(q) for q in (0.5, 0.9, 0.99, 0.999)] == [10, 50, 500, 5000]
    assert min_samples_for(1.0) == 1 and min_samples_for(0.0) == 1
    h = LogHistogram()
    h.record_many(_lognormal(9, seed=1))
    assert h.percentiles_gated() == {}
    h.record_many(_lognormal(1, seed=2))  # 10 samples
    assert list(h.percentiles_gated()) == [0.5]
    h.record_many(_lognormal(40, seed=3))  # 50
    assert list(h.percentiles_gated()) == [0.5, 0.9]
    h.record_many(_lognormal(449, seed=4))  # 499
    assert list(h.percentiles_gated()) == [0.5, 0.9]
    h.record(1.0)  # 500
    got = h.percentiles_gated()
    assert list(got) == [0.5, 0.9, 0.99]
    assert got[0.99] == h.quantile(0.99)
    assert list(h.percentiles_gated((0.99,), min_samples={0.99: 1000})) == []
    assert list(h.percentiles_gated((0.5, 1.0), min_samples={0.5: 10_000})) == [1.0]


def test_reset_and_copy_independent() -> None:
    h = LogHistogram()
    h.record_many(np.array([1.0, 2.0, 3.0]))
    c = h.copy()
    h.reset()
    assert h.count == 0 and int(h.counts.sum()) == 0 and h.max is None
    assert c.count == 3 and c.max == 3.0
    h.record(4.0)
    assert c.count == 3


def test_layout_size_and_bad_params() -> None:
    h = LogHistogram()
    # 10 µs .. 60 s at 1%: log(6e6) / log(gamma) buckets, plus under/overflow.
    n_buckets = h.counts.size - 2
    assert abs(n_buckets - math.log(6e6) / math.log(1.01 / 0.99)) <= 2
    for kw in (
        {"alpha": 0.0},
        {"alpha": 1.0},
        {"min_value": 0.0},
        {"min_value": 10, "max_value": 5},
    ):
        with pytest.raises(ValueError):
            LogHistogram(**kw)  # type: ignore[arg-type]
