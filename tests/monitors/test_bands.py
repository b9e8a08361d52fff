"""Per-layer bands and the layer that moved first (issue #46).

Ground truth: a plain Python reference of the band rule run over the same per-step RMS
values the test feeds, and the ranking rule spelled out on constructed first steps;
end to end, a gradient the test scales at one layer, and a NaN it plants in one
layer's output.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from syncless.guard import no_sync
from syncless.metrics import MetricSet
from syncless.monitors import attach, build
from syncless.monitors.attribution import Moved, _earliest
from syncless.monitors.bands import BandRule, LayerBands


def _reference(series: list[list[float]], rule: BandRule) -> dict[int, int]:
    """Layer -> the first step its RMS left its band, in plain Python."""
    first: dict[int, int] = {}
    for layer, values in enumerate(series):
        mean = var = seen = 0.0
        for step, rms in enumerate(values):
            if rms == 0:
                continue
            x = 0.5 * math.log(rms * rms) if math.isfinite(rms) else math.nan
            bad = not math.isfinite(x)
            dev = 0.0 if bad else x - mean
            outside = abs(dev) > rule.sigmas * math.sqrt(var) and abs(dev) > math.log(
                rule.min_ratio
            )
            if bad or (seen >= rule.warmup and outside):
                first.setdefault(layer, step)
                continue
            a = 1 / (seen + 1) if seen < rule.horizon else 2 / (rule.horizon + 1)
            incr = a * dev
            mean += incr
            var = (1 - a) * (var + dev * incr)
            seen += 1
    return first


def _series(layers: int, steps: int) -> list[list[float]]:
    rng = random.Random(4)
    out = [
        [(1.0 + layer) * math.exp(rng.gauss(0, 0.05)) for _ in range(steps)]
        for layer in range(layers)
    ]
    out[1][70] *= 4.0  # leaves
    out[2][40] = math.nan  # leaves at once
    out[0][5] *= 10.0  # inside the warm-up: no band yet
    out[3][90] *= 1.3  # within min_ratio: stays
    return out


def test_the_device_bands_leave_where_the_rule_says(kernel_backend):
    rule = BandRule(horizon=32, warmup=16)
    series = _series(4, 120)
    ms = MetricSet()
    means = {i: ms.declare("monitors", "grad_out_sq", "mean", layer=i) for i in range(4)}
    firsts = {
        i: ms.declare("monitors", "grad_out_band_first_step", "min", layer=i) for i in range(4)
    }
    ms.allocate("cpu")
    bands = LayerBands(ms, means, firsts, rule)
    found: dict[int, int] = {}
    with no_sync(cpu_as_device=True):
        for step in range(120):
            ms.set_step_label(step)
            for layer in range(4):
                rms = series[layer][step]
                # two samples a step, as two micro-batches: the step's mean of squares
                means[layer].add(torch.tensor(2 * rms * rms, dtype=torch.float64), count=2)
            bands.update()
            if step % 10 == 9:  # a flush restarts the buffer's sums: the bands follow
                (r,) = ms.flush(step, wait=True)
                bands.after_flush()
                for layer in range(4):
                    value = r.get(f"monitors/layer_{layer:02d}/grad_out_band_first_step")[0]
                    if not np.isnan(value):
                        found.setdefault(layer, int(value))
    assert found == _reference(series, rule) == {1: 70, 2: 40}


def test_the_layer_that_moved_first():
    forward, backward = True, False
    layers = np.arange(4)

    def signal(name, is_forward, steps):
        steps = np.array(steps, dtype=float)
        return (name, is_forward, layers, steps, np.isfinite(steps))

    inf = math.inf
    # the earliest step wins, whatever the signal
    assert _earliest(
        [
            signal("output RMS", forward, [inf, 9, inf, inf]),
            signal("gradient RMS", backward, [7, 7, 8, inf]),
        ]
    ) == Moved(7.0, 1, "gradient RMS")  # the highest layer of the gradients at step 7
    # within a step, the forward before the backward, and its lowest layer
    assert _earliest(
        [
            signal("output NaN/Inf", forward, [inf, inf, 5, 5]),
            signal("gradient RMS", backward, [5, 5, 5, 5]),
        ]
    ) == Moved(5.0, 2, "output NaN/Inf")
    assert _earliest([signal("gradient RMS", backward, [inf] * 4)]) is None


transformers = pytest.importorskip("transformers")


def _llama(layers: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _train(model, steps: int, at: int, scale: torch.Tensor, value: float) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = attach(model, build("all", optimizer=opt), lagged=False, budget=None)
    gen = torch.Generator().manual_seed(1)
    records = []
    for step in range(steps):
        ids = torch.randint(0, 64, (4, 16), generator=gen)
        scale.fill_(value if step == at else 1.0)
        with no_sync(cpu_as_device=True):
            loss = model(ids, labels=ids).loss
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            if step != at:
                opt.step()
            opt.zero_grad()
        records += handle.step(step, loss=loss.detach(), grad_norm=grad_norm)
    records += handle.close()
    return records


def _moved(records) -> list[tuple[int, float, float]]:
    step = {r.step: r.value for r in records if r.name == "monitors/step/moved_first_step"}
    layer = {r.step: r.value for r in records if r.name == "monitors/step/moved_first_layer"}
    return [(s, step[s], layer[s]) for s in sorted(step)]


def test_a_gradient_blown_up_above_a_layer_names_that_layer(kernel_backend, capfd):
    """Layer 2's output gradient scaled 50x at step 60: the gradient at every block below
    grows with it; the spike names layer 2, the highest that moved."""
    if kernel_backend == "triton":
        pytest.skip("end to end on the torch path: the kernels are checked above")
    model = _llama()
    scale = torch.ones(())

    def hook(module, args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        if hidden.requires_grad:
            hidden.register_hook(lambda g: g * scale)

    model.model.layers[2].register_forward_hook(hook)  # before attach: the monitors see it
    records = _train(model, 70, 60, scale, 50.0)
    assert _moved(records) == [(60, 60.0, 2.0)]
    line = [x for x in capfd.readouterr().err.splitlines() if "spike" in x]
    assert line and "layer 2 moved first (gradient RMS, step 60)" in line[0]


def test_a_nan_in_a_layer_output_names_that_layer(kernel_backend):
    """A NaN in layer 1's output at step 40: every later output and every gradient is
    NaN too; the forward came first, so layer 1 moved first."""
    if kernel_backend == "triton":
        pytest.skip("end to end on the torch path: the kernels are checked above")
    model = _llama()
    factor = torch.ones(())

    def plant(module, args, out):
        return (out[0] * factor, *out[1:]) if isinstance(out, tuple) else out * factor

    model.model.layers[1].register_forward_hook(plant)
    records = _train(model, 50, 40, factor, float("nan"))
    assert _moved(records) == [(40, 40.0, 1.0)]
