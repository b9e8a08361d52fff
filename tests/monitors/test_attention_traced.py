"""The attention monitor's sampled path under torch.compile (issue #20).

``measure_sampled_traced`` draws the sampling phase on the device (a host counter was a
guard dynamo recompiled on). It runs here eagerly, under ``no_sync``, against the naive
float64 loop of attention_helpers over the rows of the phase it drew; and over every
phase, its scaled entropy sums average to the sum over all rows (unbiased).
"""

from __future__ import annotations

import pytest
import torch
from attention_helpers import naive  # tests/monitors is on sys.path (no __init__.py)

from syncless.guard import no_sync
from syncless.monitors.attention_stats import build_plan, measure_sampled_traced

B, H, HKV, D = 2, 4, 2, 8


def _inputs(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    q = torch.randn(B, H, length, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, length, D, generator=g, dtype=torch.float64)
    return q, k


def _drawn(seed: int, q, k, scale, plan):
    """The phase the function draws with this seed, and its result."""
    torch.manual_seed(seed)
    phase = int(torch.randint(plan.stride, ()))
    torch.manual_seed(seed)
    with no_sync(cpu_as_device=True):
        out = measure_sampled_traced(q, k, scale, plan)
    return phase, out


@pytest.mark.parametrize(("length", "window"), [(16, None), (18, None), (16, 5)])
def test_the_device_drawn_phase_measures_its_rows_exactly(length, window):
    q, k = _inputs(length)
    scale = D**-0.5
    plan = build_plan(B, H, length, length, True, window, q.device, max_elements=B * H * 40)
    stride = plan.stride
    assert stride > 1
    n_rows = length // stride  # static shapes: 18 // 4 leaves the last 2 rows out
    for seed in range(4):
        phase, (qk_max, entropy_sum, used) = _drawn(seed, q, k, scale, plan)
        rows = range(phase, phase + n_rows * stride, stride)
        ref = naive(q, k, scale, causal=True, window=window, rows=rows)
        assert qk_max.tolist() == pytest.approx(ref.maxes, rel=1e-12)
        want = [s * stride for s in ref.entropy_sums]
        assert entropy_sum.tolist() == pytest.approx(want, rel=1e-12)
        assert float(used) == B * n_rows


def test_averaged_over_phases_the_scaled_sums_are_the_full_rows_sums():
    length = 16
    q, k = _inputs(length)
    scale = D**-0.5
    plan = build_plan(B, H, length, length, True, None, q.device, max_elements=B * H * 40)
    by_phase = {}
    for seed in range(64):
        phase, (_, entropy_sum, _) = _drawn(seed, q, k, scale, plan)
        by_phase[phase] = entropy_sum
        if len(by_phase) == plan.stride:
            break
    assert len(by_phase) == plan.stride
    mean = torch.stack(list(by_phase.values())).mean(0)
    full = naive(q, k, scale, causal=True).entropy_sums
    assert mean.tolist() == pytest.approx(full, rel=1e-12)
