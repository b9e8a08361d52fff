"""capture(..., coalesce=True): captures held and copied in one launch at a flush point,
against clones taken at capture time (ground truth), with drops recounted by hand.

Every capture runs under no_sync(); the CUDA path is in test_engine_cuda.py.
"""

from __future__ import annotations

import torch
from test_engine import cases, raw

from syncless.capture import CaptureEngine, EngineConfig, MemorySink
from syncless.guard import no_sync


def engine_for(sink: MemorySink, count: int = 1000, nbytes: int = 64 << 20) -> CaptureEngine:
    config = EngineConfig(coalesce_count=count, coalesce_bytes=nbytes)
    return CaptureEngine(64 << 20, 8 << 20, sink, device="cpu", background=False, config=config)


def by_tag(sink: MemorySink) -> dict[str, torch.Tensor]:
    return {r.tag: r.tensor().clone() for r in sink.records}


def test_coalesced_captures_are_byte_exact_in_every_layout() -> None:
    gen = torch.Generator().manual_seed(1)
    captured = cases(gen)  # every dtype; 0-d, empty, strided, conj and neg views, 4 MiB
    truth = {tag: x.clone() if x.numel() else x for tag, x in captured}
    sink = MemorySink()
    with engine_for(sink) as engine:
        with no_sync():
            for tag, x in captured:
                assert engine.capture(tag, x, step=3, coalesce=True)
        assert engine.counters()["captured_count"] == 0  # nothing copied before the flush
    got = by_tag(sink)
    assert set(got) == set(truth)
    for tag, x in truth.items():
        assert got[tag].dtype == x.dtype and got[tag].shape == x.shape, tag
        assert torch.equal(raw(got[tag]), raw(x)), tag
    assert {r.step for r in sink.records} == {3}


def test_a_tensor_changed_in_place_before_the_flush_is_dropped_not_stored() -> None:
    sink = MemorySink()
    kept = torch.arange(6, dtype=torch.float32)
    changed = torch.arange(4, dtype=torch.float32)
    base = torch.zeros(8)
    view = base[:4]
    with engine_for(sink) as engine:
        with no_sync():
            engine.capture("kept", kept, coalesce=True)
            engine.capture("changed", changed, coalesce=True)
            engine.capture("view", view, coalesce=True)
            changed.mul_(2)  # in place: the stored bytes would not be the captured ones
            base[6] = 1.0  # a write through the base moves the view's counter too
        engine.flush()
    assert by_tag(sink).keys() == {"kept"}
    assert torch.equal(by_tag(sink)["kept"], torch.arange(6, dtype=torch.float32))
    dropped = engine.dropped()
    assert dropped["modified"] == 2 and sum(dropped.values()) == 2
    c = engine.counters()
    assert c["offered_count"] == 3 and c["stored_count"] == 1
    assert c["dropped_modified_bytes"] == 4 * 4 + 4 * 4


def test_the_count_and_byte_thresholds_and_report_are_flush_points() -> None:
    sink = MemorySink()
    x = torch.ones(16)  # 64 bytes
    with engine_for(sink, count=3, nbytes=1000) as engine, no_sync():
        engine.capture("a", x, coalesce=True)
        engine.capture("b", x, coalesce=True)
        assert engine.counters()["captured_count"] == 0
        engine.capture("c", x, coalesce=True)  # the third: one launch takes all three
        assert engine.counters()["captured_count"] == 3
        engine.capture("big", torch.ones(300), coalesce=True)  # 1200 bytes >= 1000
        assert engine.counters()["captured_count"] == 4
        engine.capture("d", x, coalesce=True)
        engine.report(0)  # a step boundary
        assert engine.counters()["captured_count"] == 5
    assert [r.tag for r in sink.records] == ["a", "b", "c", "big", "d"]


def test_grad_tensors_and_inference_tensors() -> None:
    """A source that requires grad leaves the ring out of autograd; an inference tensor
    has no version counter, so it is copied at once."""
    sink = MemorySink()
    w = torch.randn(5, requires_grad=True)
    y = w * 2
    with engine_for(sink) as engine:
        with no_sync():
            engine.capture("y", y, coalesce=True)
            with torch.inference_mode():
                frozen = torch.arange(3.0)
            engine.capture("frozen", frozen, coalesce=True)
        assert engine.counters()["captured_count"] == 1  # the inference tensor, at once
        engine.flush()
        y.sum().backward()  # the graph is intact and the ring took no part in it
    got = by_tag(sink)
    assert torch.equal(got["y"], (w * 2).detach()) and torch.equal(got["frozen"], frozen)
    assert torch.equal(w.grad, torch.full((5,), 2.0))


def test_close_flushes_waiting_captures_and_the_books_balance() -> None:
    sink = MemorySink()
    engine = engine_for(sink)
    with no_sync():
        for i in range(7):
            engine.capture(f"t{i}", torch.full((3,), float(i)), step=i, coalesce=True)
    assert engine.counters()["pending_count"] == 7  # offered, not yet stored
    engine.close()
    c = engine.counters()
    assert c["offered_count"] == c["stored_count"] == 7 and c["pending_count"] == 0
    assert [r.tensor()[0].item() for r in sink.records] == [float(i) for i in range(7)]
