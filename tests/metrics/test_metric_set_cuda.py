import numpy as np
import pytest
import torch

from syncless.metrics import MetricSet

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_recording_replays_inside_a_cuda_graph():
    ms = MetricSet()
    mean = ms.declare("t", "x_mean", "mean")
    mx = ms.declare("t", "x_absmax", "max")
    ms.allocate("cuda")
    x = torch.randn(4096, device="cuda")

    def record():
        mean.add(x.sum(), x.numel())
        mx.update(x.abs().max())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        record()  # warm-up outside capture, as the CUDA graph docs ask
    torch.cuda.current_stream().wait_stream(side)
    ms.flush(0, wait=True)  # discard the warm-up values

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        record()
    ms.flush(1, wait=True)  # capture does not execute; nothing recorded

    seen = []
    for _ in range(3):
        x.copy_(torch.randn(4096, device="cuda"))
        seen.append(x.cpu().numpy())
        graph.replay()
    ms.set_enabled(False)
    x.fill_(1e6)
    graph.replay()  # gated off on the device: the same graph records nothing
    ms.set_enabled(True)
    (r,) = ms.flush(2, wait=True)
    allx = np.concatenate(seen)
    np.testing.assert_allclose(r.get("t/step/x_mean"), [allx.mean()], rtol=1e-5)
    np.testing.assert_allclose(r.get("t/step/x_absmax"), [np.abs(allx).max()], rtol=1e-6)
    assert ms.d2h_copies == 3
