"""The CPU stand-in for CUDA graphs behaves as a capture and its replays do.

Ground truth: the same region run eagerly (autograd on the same inputs), and plain
Python arithmetic for what a replay must (and must not) repeat.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncless import kernels
from syncless.graphs import StandInGraph, capturing


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(3, 4)
    model(x).sum().backward()  # gradients exist before the capture, as a graph needs
    for p in model.parameters():
        p.grad.zero_()
    return model, x


def test_a_replay_computes_the_region_again_on_new_inputs():
    model, x = _model()
    graph = StandInGraph()
    with graph.capture():
        loss = model(x).sum()
        loss.backward()
    for _ in range(3):
        for p in model.parameters():
            p.grad.zero_()
        x.copy_(torch.randn(3, 4))
        graph.replay()
        expected = model(x).sum()
        (grad,) = torch.autograd.grad(expected, model[0].weight)
        torch.testing.assert_close(loss, expected.detach())
        torch.testing.assert_close(model[0].weight.grad, grad)
    assert graph.replays == 3


def test_the_capture_leaves_older_memory_as_it_was():
    """A CUDA capture enqueues and runs nothing: gradients and accumulators written in
    the region are as before it; the first replay writes them."""
    model, x = _model()
    total = torch.zeros(())
    graph = StandInGraph()
    with graph.capture():
        loss = model(x).sum()
        loss.backward()
        total.add_(loss.detach())
    assert float(total) == 0.0
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())
    graph.replay()
    graph.replay()
    torch.testing.assert_close(total, 2 * model(x).sum().detach())


def test_python_in_the_region_runs_at_capture_only():
    model, x = _model()
    calls = []
    flag = torch.zeros(())
    seen = torch.zeros(())

    def hook(module, args, out):
        calls.append(capturing(False))
        # The host decision is frozen at capture; the device flag is read at each replay.
        seen.add_(flag)

    model[0].register_forward_hook(hook)
    graph = StandInGraph()
    with graph.capture():
        model(x)
    assert calls == [True]
    for value in (0.0, 1.0, 1.0, 0.0, 1.0):
        flag.fill_(value)
        graph.replay()
    assert calls == [True] and float(seen) == 3.0
    assert capturing(False) is False


def test_a_host_read_inside_the_capture_fails_as_on_a_gpu():
    _, x = _model()
    graph = StandInGraph()
    with pytest.raises(RuntimeError, match="reads a device value on the host"), graph.capture():
        float(x.sum())


@pytest.mark.skipif(
    not (kernels.triton_importable() and kernels.interpreting()),
    reason="needs triton and TRITON_INTERPRET=1",
)
def test_interpreted_triton_launches_are_replayed():
    from syncless.kernels.activations import nonfinite_partials

    x = torch.ones(4096)
    graph = StandInGraph()
    with graph.capture():
        counts = nonfinite_partials(x)
    x[:7] = float("nan")
    graph.replay()
    assert float(counts.sum()) == 7.0
    x[:7] = 1.0
    graph.replay()
    assert float(counts.sum()) == 0.0
