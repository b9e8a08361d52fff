"""The issue #46 kernels compiled for a GPU against their torch paths (CI runs the same
Triton code in the interpreter; this runs the compiled code on the device machine)."""

from __future__ import annotations

import math

import pytest
import torch

from syncless import kernels
from syncless.metrics import MetricSet
from syncless.monitors.bands import BandRule, LayerBands
from syncless.monitors.spikes import SpikeRule, ValueSpikes

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_stats_match_a_recount(dtype):
    g = torch.randn(4, 333, 1024, device="cuda", dtype=dtype)
    g.view(-1)[17] = float("nan")
    g.view(-1)[900] = float("inf")
    p = kernels.grad_stats_partials(g).double()
    finite = g[torch.isfinite(g)].double()
    assert int(p[:, 2].sum()) == 2
    # the sum and the max over the finite elements (the count says the rest)
    assert math.isclose(float(p[:, 1].max()), float(finite.abs().max()), rel_tol=1e-6)
    assert math.isclose(float(p[:, 0].sum()), float(finite.square().sum()), rel_tol=1e-5)


def _bands(device: str, fused: bool, series: torch.Tensor) -> torch.Tensor:
    ms = MetricSet()
    means = {i: ms.declare("m", "sq", "mean", layer=i) for i in range(series.shape[0])}
    firsts = {i: ms.declare("m", "band_first_step", "min", layer=i) for i in means}
    ms.allocate(device)
    bands = LayerBands(ms, means, firsts, BandRule(horizon=16, warmup=8))
    bands._fused = fused
    for step in range(series.shape[1]):
        ms.set_step_label(step)
        for layer in means:
            means[layer].add(series[layer, step].double().to(device) ** 2)
        bands.update()
    (r,) = ms.flush(0, wait=True)
    return torch.tensor([r.get(f"m/layer_{i:02d}/band_first_step")[0] for i in means])


def test_bands_compiled_match_the_torch_path():
    torch.manual_seed(0)
    series = torch.exp(torch.randn(6, 80) * 0.05) * torch.arange(1, 7)[:, None]
    series[2, 50] *= 5
    series[4, 30] = float("nan")
    fused = _bands("cuda", True, series)
    plain = _bands("cuda", False, series)
    torch.testing.assert_close(fused, plain, equal_nan=True)
    assert fused[2] == 50 and fused[4] == 30


def test_spikes_compiled_match_the_torch_path():
    torch.manual_seed(1)
    values = 2.0 + 0.02 * torch.randn(200)
    values[150] *= 3

    def run(fused: bool) -> list[float]:
        ms = MetricSet()
        count = ms.declare("monitors", "loss_spike_count", "sum")
        first = ms.declare("monitors", "loss_spike_first_step", "min")
        ms.allocate("cuda")
        spikes = ValueSpikes(ms, count, first, SpikeRule())
        spikes._fused = fused
        for step, v in enumerate(values):
            ms.set_step_label(step)
            spikes.update(v.cuda())
        (r,) = ms.flush(0, wait=True)
        return [
            r.get("monitors/step/loss_spike_count")[0],
            r.get("monitors/step/loss_spike_first_step")[0],
        ]

    assert run(True) == run(False) == [1.0, 150.0]
