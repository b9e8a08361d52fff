"""The engine's threads run no torch CPU op on the CPU path.

A torch op on a CPU tensor from a thread of its own starts an OpenMP team for that
thread, whose spinning workers take the cores of the training thread's team: on the
2-core CI host, capturing every layer of a 16-layer model cost its step +166%, and
+23% once the drain copied with a memmove (syncless/capture/drain/staging.py). The spy below records the thread of every
``Tensor.copy_``/``clone`` call while the engine stores a mix of records (an oversized
one and empty ones included) into a MemorySink, which copies them on a writer thread.
"""

from __future__ import annotations

import threading

import pytest
import torch

from syncless.capture import CaptureEngine, MemorySink
from syncless.guard import no_sync

MiB = 1 << 20


@pytest.fixture
def torch_op_threads(monkeypatch) -> list[str]:
    names: list[str] = []
    for method in ("copy_", "clone"):
        original = getattr(torch.Tensor, method)

        def spy(self, *args, _original=original, **kwargs):
            names.append(threading.current_thread().name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, spy)
    return names


def test_the_drain_and_writers_copy_without_torch_ops(torch_op_threads) -> None:
    sink = MemorySink()  # its copies of the records are made on a writer thread
    engine = CaptureEngine(16 * MiB, MiB, sink, device="cpu", on_full="block")
    sizes = [1024, 16, 300_000, 4096, 1, 0]  # 300k floats: larger than staging (oversized)
    sent = [torch.full((n,), float(i)) for i, n in enumerate(sizes * 4)]
    with no_sync():
        for i, x in enumerate(sent):
            assert engine.capture("x", x, step=i)
    engine.close()
    assert len(sink.records) == len(sent)
    assert all(torch.equal(got, x) for got, x in zip(sink.tensors(), sent, strict=True))
    engine_threads = {n for n in torch_op_threads if n.startswith("syncless-capture")}
    assert not engine_threads, engine_threads
    assert "MainThread" in torch_op_threads  # the spy saw the training thread's copies
