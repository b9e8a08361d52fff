"""CUDA paths of the capture engine: device ring, copy stream, boundary events (needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from syncless.capture import CaptureEngine, MemorySink, WindowPattern
from syncless.guard import no_sync

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_round_trip_from_hooks_under_no_sync() -> None:
    sink = MemorySink()
    engine = CaptureEngine(64 << 20, 4 << 20, sink)  # the staging ring is pinned
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU()).cuda().bfloat16()
    expected = []

    def hook(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        engine.capture("out", out)
        expected.append(out.detach().clone())

    model[1].register_forward_hook(hook)
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(2 << 20, device="cuda")  # 8 MiB > staging: an oversized flush
    with no_sync():  # CUDA: also torch's sync debug mode, process-wide
        for _ in range(10):
            model(x)
        engine.capture("big", big)
        engine.capture("strided", big.view(1024, -1)[::3, 1::2])
    engine.close()
    got = [r.tensor() for r in sink.records]
    want = [t.cpu() for t in expected] + [big.cpu(), big.view(1024, -1)[::3, 1::2].cpu()]
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert engine.counters()["flush_oversized_count"] == 1


def test_window_transfers_are_timed_on_the_device() -> None:
    engine = CaptureEngine(64 << 20, 16 << 20, MemorySink())
    engine.define_pattern(WindowPattern(2, [(0, 1)]))
    a = torch.randn(4096, 4096, device="cuda")
    for step in range(20):
        engine.capture("x", torch.full((1024,), float(step), device="cuda"), step=step)
        engine.advance_boundary()  # OPEN
        for _ in range(4):
            a = (a @ a).clamp_(-1, 1)  # a window of milliseconds
        engine.advance_boundary()  # CLOSE
    torch.cuda.synchronize()
    engine.close()
    reports = engine.window_reports()
    assert [r.step for r in engine.sink.records] == list(range(20))  # type: ignore[attr-defined]
    measured = [r for r in reports if not r.close_late]
    assert measured, reports
    assert all(r.window_s is None or r.window_s > 0 for r in measured)
    assert all(r.transfer_s is not None and r.transfer_s >= 0 for r in measured)


def test_advance_boundary_replays_in_a_cuda_graph() -> None:
    engine = CaptureEngine(1 << 20, 1 << 16, MemorySink())
    engine.define_pattern(WindowPattern(2, [(0, 1)]))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the graph
        engine.advance_boundary()
        engine.advance_boundary()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the drain thread may query events while this thread captures.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        engine.advance_boundary()
        engine.advance_boundary()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    version, count = engine._boundary.read()
    assert (version, count) == (1, 2 + 2 * 3)  # captured launches did not run at capture
    # A replay advances the device count only: eager boundaries now count from it too.
    assert engine._boundary._eager is None
    engine.advance_boundary()
    torch.cuda.synchronize()
    assert engine._boundary.read() == (1, 2 + 2 * 3 + 1)
    engine.close()


def test_eager_boundaries_are_driver_writes_and_count_exactly() -> None:
    from syncless.capture.windows import pack

    engine = CaptureEngine(1 << 20, 1 << 16, MemorySink())
    version = engine.define_pattern(WindowPattern(2, [(0, 1)]))
    clock = engine._boundary
    assert clock._eager is not None  # the driver path on this machine
    a = torch.randn(2048, 2048, device="cuda")
    with no_sync():
        for _ in range(50):
            a = (a @ a).clamp_(-1, 1)
            engine.advance_boundary()
    torch.cuda.synchronize()
    assert int(clock._host[0]) == pack(version, 50)
    assert int(clock._counter) == 50  # the device count a later graph would go on from
    assert clock.read() == (version, 50)
    engine.close()


def _planned_engine() -> tuple[CaptureEngine, MemorySink]:
    sink = MemorySink()
    engine = CaptureEngine(16 << 20, 4 << 20, sink, background=False)
    engine.define_pattern(WindowPattern(2, [(0, 1)]))
    torch.cuda.synchronize()  # the new pattern's word has reached the host
    return engine, sink


def test_a_planned_copy_launches_at_its_window_open() -> None:
    """The drain decides the next window's copy ahead; advance_boundary() launches it
    at the OPEN, behind the OPEN's stamp, so it starts when the device gets there."""
    engine, sink = _planned_engine()
    x = torch.arange(1 << 16, device="cuda", dtype=torch.float32)
    with no_sync():
        engine.capture("x", x, step=0)
    torch.cuda.synchronize()  # the record is ready
    engine.poll()
    assert engine.counters()["window_planned_count"] == 1
    assert engine.counters()["d2h_bytes"] == 0  # planned, not copied
    torch.cuda.synchronize()  # nothing is held on the device for the window
    with no_sync():
        torch.cuda._sleep(20_000_000)  # the device is behind the host at the OPEN
        engine.advance_boundary()  # OPEN: the copy is launched here
        torch.cuda._sleep(20_000_000)  # a window of milliseconds
        engine.advance_boundary()  # CLOSE
    assert engine.counters()["window_launched_count"] == 1
    torch.cuda.synchronize()
    for _ in range(3):
        engine.poll()
    (report,) = engine.window_reports()
    # Not issued late, and not before the OPEN either (that also reads as issued late).
    assert report.before_close and not report.issued_late and not report.close_late
    engine.close()
    assert torch.equal(sink.records[0].tensor(), x.cpu())


def test_close_drops_a_plan_whose_window_never_comes() -> None:
    engine, sink = _planned_engine()
    x = torch.randn(1 << 16, device="cuda")
    engine.capture("x", x)
    torch.cuda.synchronize()
    engine.poll()
    assert engine.counters()["window_planned_count"] == 1
    engine.close()  # no boundary is ever published: the lifecycle flush takes the record
    assert torch.equal(sink.records[0].tensor(), x.cpu())
    c = engine.counters()
    assert c["window_plan_dropped_count"] == 1 and c["window_launched_count"] == 0
    assert c["d2h_flush_bytes"] > 0 and c["d2h_window_bytes"] == 0


def test_driver_copies_are_byte_exact_and_ordered_on_the_current_stream() -> None:
    """Contiguous tensors go through cuMemcpyDtoDAsync on the current stream (here a
    side stream whose producer kernel is still running); every other layout through
    torch. Ground truth: clones taken on the producing stream."""
    from syncless.capture.ring.copier import RingCopier

    driver_copies, deferred, streams = [], [], []
    original = RingCopier._driver_copy

    def spy(self, rec, tensor, stream, defer):
        done = original(self, rec, tensor, stream, defer)
        driver_copies.append(done)
        streams.append(stream)
        deferred.append(defer and done and rec.landed is None)
        return done

    sink = MemorySink()
    engine = CaptureEngine(256 << 20, 64 << 20, sink)
    side = torch.cuda.Stream()
    base = torch.randn(2048, 2048, device="cuda")
    want = []
    RingCopier._driver_copy = spy
    try:
        with no_sync(), torch.cuda.stream(side):
            for i in range(4):
                a = base
                for _ in range(8):  # milliseconds of work before the tensor exists
                    a = (a @ base).tanh_()
                tensors = [
                    a,  # contiguous: the driver's copy
                    a[7:9],  # a storage offset
                    a.bfloat16(),
                    (a[:4, :4] + 1j * a[4:8, :4]).conj(),  # the conjugate bit: torch's path
                    -a[:3],  # a negated view is materialised by the op itself
                    a.t(),  # strided: torch's path
                    a[0, 0],  # 0-d
                    a[:0],  # empty
                ]
                for j, t in enumerate(tensors):
                    engine.capture(f"t{j}", t, step=i)
                    want.append(t.resolve_conj().clone())
        side.synchronize()
    finally:
        RingCopier._driver_copy = original
    engine.close()
    got = [r.tensor() for r in sink.records]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(
            g.reshape(-1).view(torch.uint8), w.cpu().contiguous().reshape(-1).view(torch.uint8)
        )
    assert any(driver_copies), "no capture took the driver's path"
    assert set(streams) == {side.cuda_stream}  # enqueued where the tensors were made
    # Batching: every driver copy left its landing event to the drain.
    assert deferred == driver_copies


def test_capture_inside_cuda_graph_capture_raises_and_leaves_nothing_behind() -> None:
    # capture() asks whether the current stream is being captured only off the legacy
    # default stream (which CUDA never captures); torch.cuda.graph captures on its own.
    engine = CaptureEngine(1 << 20, 1 << 16, MemorySink())
    x = torch.randn(256, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.raises(RuntimeError, match="inside CUDA graph capture"),
        torch.cuda.graph(graph, capture_error_mode="thread_local"),
    ):
        engine.capture("in_graph", x * 2)
    torch.cuda.synchronize()
    with no_sync():
        assert engine.capture("after", x)  # the legacy default stream again
    engine.close()
    assert [r.tag for r in engine.sink.records] == ["after"]  # type: ignore[attr-defined]
    assert torch.equal(engine.sink.records[0].tensor(), x.cpu())  # type: ignore[attr-defined]
    assert engine.counters()["offered_count"] == 1  # the refused call offered nothing
