"""The compiled Triton kernels on a GPU: same values as the torch path, sync-free,
replayable in a CUDA graph."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from syncless import kernels
from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.metrics import MetricSet
from syncless.monitors import build
from syncless.monitors.adapters import find_layers
from syncless.monitors.base import MonitorContext
from syncless.monitors.output_read import fuse_output_reads

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not kernels.triton_importable(), reason="needs CUDA"
    ),
]
NAMES = ["attention", "moe", "activations", "nonfinite"]


@contextmanager
def _backend(name: str) -> Iterator[None]:
    previous = kernels.backend()
    kernels.set_backend(name)
    try:
        yield
    finally:
        kernels.set_backend(previous)


def _model() -> MoETransformer:
    """The same small demo model on the GPU for every backend and launch mode."""
    torch.manual_seed(0)
    model = MoETransformer(preset("tiny", n_layers=3, d_model=128, n_heads=4)).cuda()
    init_weights(model, 0)
    return model


def _readout(
    backend: str, tokens: torch.Tensor, poison: bool, launch: str = "layer"
) -> dict[str, np.ndarray]:
    with _backend(backend):
        model = _model()
        if poison:  # NaN in the last layer's output: counted, and raised as the alert
            at = torch.tensor([3], device="cuda")

            def plant(module, args, out):
                return out[0].index_fill(1, at, float("nan")), out[1]

            model.layers[-1].register_forward_hook(plant)
        ctx = MonitorContext(find_layers(model), MetricSet())
        monitors = build(NAMES)
        for m in monitors:
            m.launch = "grouped" if launch == "shared" else launch
            m.prepare(ctx)
        ctx.metrics.allocate("cuda")
        for m in monitors:
            m.attach(ctx)
        shared = fuse_output_reads(ctx, monitors) if launch == "shared" else None
        with no_sync(), torch.autocast("cuda", dtype=torch.bfloat16):
            model(tokens)
            model(tokens[:1, :40])  # a second shape: accumulation across calls
        for batch in ctx.batches:
            batch.launch()
        if launch == "grouped":
            assert all(b.grouped_launches == 2 for b in ctx.batches), "one per forward"
        if launch == "shared":  # activations and nonfinite read each output once, together
            assert shared is not None and shared.grouped_launches == 2
            launched = sorted(b.grouped_launches for b in ctx.batches)
            assert launched == [0, 0, 2, 2, 2], launched
        (out,) = ctx.metrics.flush(0, wait=True)
        return out.values


@pytest.mark.parametrize("poison", [False, True])
def test_triton_and_torch_paths_agree_under_bf16_autocast(poison):
    tokens = torch.randint(0, 256, (4, 64), device="cuda")  # tiny: seq_len 64
    ref = _readout("torch", tokens, poison)
    got = _readout("triton", tokens, poison)
    assert ref.keys() == got.keys()
    for key in ref:
        if "nonfinite" in key or "tokens_count" in key:
            np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
        elif "act_channel_absmax" in key and poison:
            continue  # NaN: the torch max propagates it, the kernel skips it (documented)
        else:
            np.testing.assert_allclose(got[key], ref[key], rtol=2e-3, atol=1e-4, err_msg=key)


@pytest.mark.parametrize("launch", ["grouped", "shared"])
@pytest.mark.parametrize("poison", [False, True])
def test_grouped_launches_agree_with_per_layer_launches(poison, launch):
    """launch="grouped" (one kernel per monitor per forward), and with activations and
    nonfinite sharing one read ("shared"), on the compiled kernels."""
    tokens = torch.randint(0, 256, (4, 64), device="cuda")
    ref = _readout("triton", tokens, poison)
    got = _readout("triton", tokens, poison, launch=launch)
    assert ref.keys() == got.keys()
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-6, atol=0, err_msg=key)


def test_fused_record_replays_in_a_cuda_graph():
    from syncless.metrics.slot_group import Column, SlotGroup

    ms = MetricSet()
    peak = ms.declare("t", "x_absmax", "max", size=256)
    bad = ms.declare("t", "x_nonfinite_count", "sum")
    alert = ms.declare("t", "alert_count", "max")
    ms.allocate("cuda")
    m2 = ms.declare("t", "x_m2", "mean")
    m4 = ms.declare("t", "x_m4", "mean")
    peak_group = SlotGroup(ms, [Column(peak), Column(m2), Column(m4)])  # the kernel's columns
    bad_group = SlotGroup(ms, [Column(bad, also_max=alert)])
    x = torch.randn(512, 256, device="cuda")

    def record():
        peak_group.fold(kernels.channel_absmax_partials(x), 1)
        bad_group.fold(kernels.nonfinite_partials(x), 1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        record()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    ms.flush(0, wait=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        record()
    seen = []
    for i in range(3):
        x.copy_(torch.randn(512, 256, device="cuda") * (i + 1))
        x[i, i] = float("inf")
        seen.append(x.cpu().numpy())
        graph.replay()
    (out,) = ms.flush(1, wait=True)
    expected = np.max([np.abs(s).max(0) for s in seen], axis=0)  # inf where planted
    np.testing.assert_array_equal(out.values["t/step/x_absmax"], expected)
    assert out.values["t/step/x_nonfinite_count"] == 3
    assert out.values["t/step/alert_count"] == 1


def _norms_readout(backend: str) -> dict[str, np.ndarray]:
    from syncless.monitors.norms import NormsMonitor

    with _backend(backend):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # a sync-free step
        ctx = MonitorContext(find_layers(model), MetricSet())
        mon = NormsMonitor(opt, every=1)
        mon.prepare(ctx)
        ctx.metrics.allocate("cuda")
        mon.attach(ctx)
        assert (mon._fused[0] is not None) == (backend == "triton")
        tokens = torch.randint(0, 256, (4, 64), device="cuda")
        with no_sync():
            logits, balance = model(tokens)
            (logits.float().square().mean() + balance).backward()
            opt.step()
        (out,) = ctx.metrics.flush(0, wait=True)
        return out.values


def test_fused_norms_agree_with_the_foreach_path():
    """Per-group sums of squares of parameters, gradients and the update, in one launch
    per quantity, against torch's _foreach_norm path on the same step."""
    ref = _norms_readout("torch")
    got = _norms_readout("triton")
    assert ref.keys() == got.keys()
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=0, err_msg=key)
