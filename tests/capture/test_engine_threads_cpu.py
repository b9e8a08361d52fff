"""The engine's threads run no torch CPU op on the CPU path.

A torch op on a CPU tensor from a thread of its own starts an OpenMP team for that
thread, whose spinning workers take the cores of the training thread's team: on the
2-core CI host, capturing every layer of a 16-layer model cost its step +166%, and
+23% once the drain copied with a memmove (syncless/capture/staging_copy.py). The spy below records the thread of every
``Tensor.copy_``/``clone`` call while the engine stores a mix of records, an oversized
one included.
"""

from __future__ import annotations

import threading

import pytest
import torch

from syncless.capture import CaptureEngine
from syncless.guard import no_sync

MiB = 1 << 20


class CheckingSink:
    """Keeps each record's first float, read on the writer thread without a torch op."""

    def __init__(self) -> None:
        self.first: list[float] = []

    def write(self, records) -> None:
        self.first += [float(r.data[:4].numpy().view("float32")[0]) for r in records]

    def close(self) -> None:
        pass


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
    sink = CheckingSink()
    engine = CaptureEngine(16 * MiB, MiB, sink, device="cpu", on_full="block")
    sizes = [1024, 16, 300_000, 4096, 1]  # 300k floats: larger than staging (oversized)
    with no_sync():
        for i, n in enumerate(sizes * 4):
            assert engine.capture("x", torch.full((n,), float(i)), step=i)
    engine.close()
    assert sorted(sink.first) == [float(i) for i in range(len(sizes) * 4)]  # writers: any order
    engine_threads = {n for n in torch_op_threads if n.startswith("syncless-capture")}
    assert not engine_threads, engine_threads
    assert "MainThread" in torch_op_threads  # the spy saw the training thread's copies
