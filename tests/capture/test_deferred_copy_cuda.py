"""Deferred copies on CUDA: the drain enqueues the driver's copy on the capture's stream
(needs a GPU). Ground truth: clones taken on the producing stream at the capture."""

from __future__ import annotations

import time

import pytest
import torch

from syncless.capture import CaptureEngine, EngineConfig, MemorySink
from syncless.cuda_driver import driver
from syncless.guard import no_sync

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("on", ["side stream", "default stream"])
@pytest.mark.parametrize("background", [True, False])
def test_held_copies_land_in_order_on_the_capture_stream(background: bool, on: str) -> None:
    """On the legacy default stream the drain's batch goes to a blocking stream, which
    the legacy stream orders as itself; a side stream takes it directly."""
    sink = MemorySink()
    # The host outruns the drain by far (4 MiB per step of microseconds): a full ring
    # waits rather than drops, so every capture is stored and compared.
    engine = CaptureEngine(
        256 << 20,
        16 << 20,
        sink,
        background=background,
        on_full="block",
        config=EngineConfig(defer_copy_below=64 << 10, gather_interval_s=0.001),
    )
    side = torch.cuda.Stream() if on == "side stream" else torch.cuda.default_stream()
    base = torch.randn(1024, 1024, device="cuda")
    model = torch.nn.Sequential(torch.nn.Linear(1024, 64), torch.nn.GELU()).cuda()
    want: list[torch.Tensor] = []

    def hook(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        assert engine.capture("gelu", out)
        want.append(out.detach().clone())

    model[1].register_forward_hook(hook)
    with no_sync(), torch.cuda.stream(side):
        for step in range(200):
            a = base
            for _ in range(2):  # device work still running when the capture returns
                a = (a @ base).tanh_()
            with torch.no_grad():
                model(a[:8])  # 8 x 64 floats: 2 KiB, deferred
            engine.capture("row", a[step % 1024], step=step)  # 4 KiB, deferred
            want.append(a[step % 1024].clone())
            engine.capture("big", a)  # 4 MiB: copied at the call
            want.append(a.clone())
            if not background and step % 50 == 49:
                engine.poll()
    side.synchronize()
    engine.close()
    got = [r.tensor() for r in sink.records]
    assert len(got) == len(want) == 600
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w.cpu())
    assert sum(engine.dropped().values()) == 0


def test_a_change_before_the_drains_look_drops_a_held_copy() -> None:
    engine = CaptureEngine(
        16 << 20,
        4 << 20,
        MemorySink(),
        background=False,
        config=EngineConfig(defer_copy_below=1024),
    )
    x = torch.arange(64.0, device="cuda")
    with no_sync():
        engine.capture("x", x)
        engine.capture("y", x * 2)
        x.relu_()  # in place: the version counter moves
    engine.close()
    assert engine.dropped()["changed"] == 1
    (rec,) = engine.sink.records  # type: ignore[attr-defined]
    assert rec.tag == "y" and torch.equal(rec.tensor(), torch.arange(64.0) * 2)


def test_stream_capturing_sees_a_cuda_graph_capture() -> None:
    capturing = driver().stream_capturing_fn()
    stream = torch.cuda.Stream()
    x = torch.ones(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    assert not capturing(stream.cuda_stream)
    with torch.cuda.graph(graph, stream=stream):
        seen = capturing(stream.cuda_stream)
        x.mul_(2)
    assert seen and not capturing(stream.cuda_stream)


@pytest.mark.parametrize("defer", [True, False])
def test_a_cuda_graph_captured_while_the_drain_works_stays_valid(defer: bool) -> None:
    """Records wait in the engine (held copies, or landing events the drain is to
    record) on the very stream the training thread then captures a graph on. The drain,
    looking every millisecond meanwhile, must neither enqueue on that stream (the work
    would join the graph) nor make a call that invalidates the capture."""
    engine = CaptureEngine(
        64 << 20,
        8 << 20,
        MemorySink(),
        config=EngineConfig(defer_copy_below=1 << 20 if defer else 0, gather_interval_s=1e-3),
    )
    stream = torch.cuda.Stream()
    x = torch.arange(1024.0, device="cuda")
    with torch.cuda.stream(stream):
        want = [torch.full((256,), float(i), device="cuda") for i in range(300)]
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with no_sync(), torch.cuda.stream(stream):
        for i, t in enumerate(want):
            assert engine.capture(f"t{i}", t, step=i)
    with torch.cuda.graph(graph, stream=stream):
        y = x * 2
        for _ in range(20):  # about 20 ms of capture while the drain looks
            y = y + 0
            time.sleep(1e-3)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    engine.close()
    assert torch.equal(y, x * 2)
    got = [r.tensor() for r in engine.sink.records]  # type: ignore[attr-defined]
    assert len(got) == len(want) and sum(engine.dropped().values()) == 0
    assert all(torch.equal(g, w.cpu()) for g, w in zip(got, want, strict=True))


def test_the_drivers_batch_copy_is_byte_exact() -> None:
    batch = driver().memcpy_batch_fn(torch.cuda.current_device())
    if batch is None:
        pytest.skip("cuMemcpyBatchAsync needs a CUDA 12.8 driver")
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device="cuda", generator=gen)
    dst = torch.zeros_like(src)
    sizes = [1, 7, 64, 4096, 100_003, 1 << 18, 3, 1 << 20]
    src_at = [5, 9_000, 20_000, 31_111, 200_000, 1_000_000, 2_000_000, 3_000_000]
    dst_at, at = [], 0
    for n in sizes:
        dst_at.append(at)
        at += n + 13  # gaps stay zero
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    args = ([dst.data_ptr() + d for d in dst_at], [src.data_ptr() + s for s in src_at], sizes)
    assert batch(*args, 0) != 0  # the legacy default stream is refused (the copier knows)
    assert batch(*args, side.cuda_stream) == 0
    side.synchronize()
    want = torch.zeros_like(src).cpu()
    host = src.cpu()
    for n, s, d in zip(sizes, src_at, dst_at, strict=True):
        want[d : d + n] = host[s : s + n]
    assert torch.equal(dst.cpu(), want)
