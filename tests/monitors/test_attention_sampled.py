"""AttentionMonitor's sampled mode: above the element budget it uses every stride-th row.

The stride keeps the budget; each call's rows (rotating phase) match the naive
reference on those rows, and one cycle of phases uses every row once. The fused
kernel has its own budget, and the grouped launch steps aside for the per-layer path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_helpers import (  # tests/monitors is on sys.path (no __init__.py)
    check,
    fake_site,
    flush,
    monitored,
    naive,
    qk,
)

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.metrics import MetricSet
from syncless.monitors.adapters import find_layers
from syncless.monitors.attention import AttentionMonitor
from syncless.monitors.attention_stats import row_stride, rows_at_phase
from syncless.monitors.base import MonitorContext

# -- sampled mode -------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 10, 100, 1000, 4096, 10**6])
@pytest.mark.parametrize(
    ("batch", "heads", "q_len", "k_len"), [(1, 1, 1, 1), (2, 4, 37, 37), (3, 8, 100, 260)]
)
def test_row_stride_keeps_the_budget(budget, batch, heads, q_len, k_len):
    stride = row_stride(batch, heads, q_len, k_len, budget)
    used = rows_at_phase(q_len, stride, 0)
    assert 1 <= used <= q_len and used == len(range(0, q_len, stride))
    if stride == 1:
        assert batch * heads * q_len * k_len <= budget
    elif batch * heads * k_len <= budget:  # below one row per sequence it cannot hold
        assert batch * heads * used * k_len <= budget
        # and the stride is the smallest that holds it
        assert batch * heads * rows_at_phase(q_len, stride - 1, 0) * k_len > budget


@pytest.mark.parametrize(
    ("heads", "kv_heads", "q_len", "k_len", "causal", "window"),
    [
        pytest.param(4, 2, 20, 20, True, None, id="gqa-causal"),
        pytest.param(4, 4, 20, 26, False, None, id="cross"),
        pytest.param(4, 1, 20, 20, True, 5, id="mqa-window"),
    ],
)
def test_sampled_mode_matches_the_reference_on_the_sampled_rows(
    heads, kv_heads, q_len, k_len, causal, window, kernel_backend
):
    batch = 2
    # 7 rows fit: stride 3, phases 0 and 1 use 7 rows, phase 2 uses 6.
    budget = batch * heads * k_len * 7
    site = fake_site(heads=heads, kv_heads=kv_heads, causal=causal, window=window)
    mon, ms = monitored([site], max_elements=budget)
    q, k = qk(batch, heads, kv_heads, q_len, k_len, seed=5)
    exact = naive(q, k, site.scale, causal, window)
    stride = 3
    total = None
    for phase in range(stride):
        site.fire(q, k)
        rows = range(phase, q_len, stride)
        ref = naive(q, k, site.scale, causal, window, rows=rows)
        check(flush(ms), ref, scaled_by=stride, frac=len(rows) / q_len)
        # a lower bound of the exact max
        assert all(s <= e + 1e-9 for s, e in zip(ref.maxes, exact.maxes, strict=True))
        total = ref if total is None else total.merge(ref)
    assert mon.plans.builds == (1 if kernel_backend == "torch" else 0)  # the kernel needs none
    # Over one cycle of phases every row is used once: exact max, exact mean entropy.
    np.testing.assert_allclose(total.maxes, exact.maxes, rtol=1e-12)
    np.testing.assert_allclose(total.entropy_sums, exact.entropy_sums, rtol=1e-9)
    for _ in range(stride):
        site.fire(q, k)
    # 3 calls: Σ 3 * sampled / (3 * B * L) is the exact mean; each row was used once in 3
    check(flush(ms), exact, frac=1 / stride)


def test_sampled_mode_is_used_only_above_the_budget():
    q, k = qk(2, 2, 2, 8)
    elements = 2 * 2 * 8 * 8
    for budget, stride in ((elements, 1), (elements - 1, 2)):
        site = fake_site(heads=2, kv_heads=2)
        _, ms = monitored([site], max_elements=budget)
        site.fire(q, k)
        ref = naive(q, k, site.scale, True, rows=range(0, 8, stride))
        check(flush(ms), ref, scaled_by=stride, frac=1 / stride)


def test_grouped_launch_takes_the_per_layer_path_in_sampled_mode(kernel_backend):
    """Above the budget each layer rotates its own sampling phase: the grouped kernel
    (exact rows only) steps aside, and the values equal the per-layer launches'."""
    if kernel_backend != "triton":
        pytest.skip("the grouped path is the Triton path")
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(4))
    readouts = {}
    for launch in ("layer", "grouped"):
        model = MoETransformer(preset("tiny"))
        init_weights(model, seed=0)
        ctx = MonitorContext(find_layers(model), MetricSet())
        mon = AttentionMonitor(max_elements=64, fused_max_elements=64, launch=launch)
        mon.prepare(ctx)
        ctx.metrics.allocate("cpu")
        mon.attach(ctx)
        with no_sync(cpu_as_device=True), torch.no_grad():
            for _ in range(3):
                model(tokens)
        readouts[launch] = flush(ctx.metrics)
        if launch == "grouped":
            assert mon._batch.grouped_launches == 0
            assert mon._batch.single_launches == 3 * len(model.layers)
    for key in readouts["layer"].values:
        np.testing.assert_array_equal(
            readouts["layer"].values[key], readouts["grouped"].values[key]
        )


def test_the_fused_path_has_its_own_budget(kernel_backend):
    """The fused kernel keeps no logits: above the torch path's memory budget it is still
    exact while its own budget holds; the torch path samples."""
    q, k = qk(2, 2, 2, 8)
    elements = 2 * 2 * 8 * 8
    site = fake_site(heads=2, kv_heads=2)
    _, ms = monitored([site], max_elements=elements - 1, fused_max_elements=elements)
    site.fire(q, k)
    stride = 1 if kernel_backend == "triton" else 2
    ref = naive(q, k, site.scale, True, rows=range(0, 8, stride))
    check(flush(ms), ref, scaled_by=stride, frac=1 / stride)
