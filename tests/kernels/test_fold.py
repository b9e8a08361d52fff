"""SlotGroup.fold (one Triton launch) against a numpy recount of the same partials.

Runs the compiled kernel on CUDA, the Triton interpreter elsewhere (tests/conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncless import kernels
from syncless.metrics import MetricSet
from syncless.metrics.slot_group import Column, SlotGroup

pytestmark = pytest.mark.skipif(
    not kernels.triton_importable() or not (torch.cuda.is_available() or kernels.interpreting()),
    reason="needs triton with a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _metrics():
    ms = MetricSet()
    slots = dict(
        mean=ms.declare("t", "v_mean", "mean", size=3),
        total=ms.declare("t", "n_count", "sum"),
        peak=ms.declare("t", "v_max", "max", size=3),
        alert=ms.declare("t", "alert_count", "max"),
        wide=ms.declare("t", "w_max", "max", size=8),
    )
    ms.allocate(DEVICE)
    return ms, slots


def _group(ms, s):
    return SlotGroup(
        ms,
        [
            Column(s["mean"]),
            Column(s["total"], also_max=s["alert"]),
            Column(s["peak"]),
            Column(s["wide"], width=4, start=2),  # a shard writing elements 2..5
        ],
    )


def test_fold_matches_a_numpy_recount_over_calls():
    ms, s = _metrics()
    group = _group(ms, s)
    rng = np.random.default_rng(0)
    calls = [(rng.normal(size=(p, 11)).astype(np.float32), n) for p, n in ((5, 7), (40, 3))]
    for part, _ in calls:  # the also_max column holds counts: non-negative (its contract)
        part[:, 3] = rng.integers(0, 9, size=len(part))
    for part, n in calls:
        group.fold(torch.from_numpy(part).to(DEVICE), n)
    (out,) = ms.flush(0, wait=True)
    sums = sum(p[:, 0:3].astype(np.float64).sum(0) for p, _ in calls)
    counts = sum(n for _, n in calls)
    np.testing.assert_allclose(out.values["t/step/v_mean"], sums / counts, rtol=1e-12)
    totals = [p[:, 3].astype(np.float64).sum() for p, _ in calls]
    np.testing.assert_allclose(out.values["t/step/n_count"], sum(totals), rtol=1e-12)
    np.testing.assert_allclose(out.values["t/step/alert_count"], max(totals), rtol=1e-12)
    peak = np.max([p[:, 4:7].max(0) for p, _ in calls], axis=0)
    np.testing.assert_array_equal(out.values["t/step/v_max"], peak)
    wide = np.max([p[:, 7:11].max(0) for p, _ in calls], axis=0)
    np.testing.assert_array_equal(out.values["t/step/w_max"][2:6], wide)
    assert not out.present["t/step/w_max"][[0, 1, 6, 7]].any()  # other shards' elements


def test_fold_with_the_gate_off_changes_nothing():
    ms, s = _metrics()
    group = _group(ms, s)
    ms.set_enabled(False)
    group.fold(torch.ones(4, 11, device=DEVICE), 5)
    ms.set_enabled(True)
    (out,) = ms.flush(0, wait=True)
    assert not any(out.present[k].any() for k in out.present)


def test_columns_sharing_one_also_max_target_feed_it_the_largest_sum():
    """A grouped fold: every layer's count column feeds one alert (an atomic max across
    programs: 300 columns span three of them)."""
    ms = MetricSet()
    counts = [ms.declare("t", "n_count", "sum", layer=i) for i in range(300)]
    alert = ms.declare("t", "alert_count", "max")
    ms.allocate(DEVICE)
    group = SlotGroup(ms, [Column(c, also_max=alert) for c in counts])
    rng = np.random.default_rng(1)
    calls = [rng.integers(0, 5, size=(7, 300)).astype(np.float32) for _ in range(2)]
    calls[1][:, 250] = 0
    calls[1][3, 250] = 1000  # the largest column sum, in the last program's columns
    for part in calls:
        group.fold(torch.from_numpy(part).to(DEVICE), 7)
    (out,) = ms.flush(0, wait=True)
    largest = max(p.astype(np.float64).sum(0).max() for p in calls)  # per call, not summed
    assert out.values["t/step/alert_count"][0] == largest == 1000
    for i, c in enumerate(counts):
        assert out.values[c.spec.key][0] == sum(p[:, i].sum() for p in calls)


def test_group_refuses_bad_columns():
    ms, s = _metrics()
    with pytest.raises(ValueError, match="outside metric 't/step/w_max' of size 8"):
        SlotGroup(ms, [Column(s["wide"], width=4, start=6)])
    with pytest.raises(ValueError, match="also_max needs a max metric of size 3"):
        SlotGroup(ms, [Column(s["mean"], also_max=s["alert"])])
    unallocated = MetricSet()
    unallocated.declare("t", "x_max", "max")
    with pytest.raises(RuntimeError, match="allocate"):
        SlotGroup(unallocated, [])
