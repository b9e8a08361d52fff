"""ByteRing against a byte-occupancy model: whole reservations, in bounds, never overlapping."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from syncless.capture import CaptureEngine, MemorySink
from syncless.capture.ring.byte_ring import ByteRing


class Model:
    """Which bytes are live, and the FIFO of live reservations."""

    def __init__(self, capacity: int) -> None:
        self.owner: list[int | None] = [None] * capacity
        self.live: list[tuple[int, int, int]] = []  # (id, offset, span)

    def place(self, rid: int, offset: int, span: int) -> None:
        assert offset >= 0 and offset + span <= len(self.owner), "reservation out of bounds"
        for b in range(offset, offset + span):
            assert self.owner[b] is None, f"byte {b} reserved twice"
            self.owner[b] = rid
        self.live.append((rid, offset, span))

    def free(self) -> tuple[int, int]:
        _, offset, span = self.live.pop(0)
        for b in range(offset, offset + span):
            self.owner[b] = None
        return offset, span


@pytest.mark.parametrize("seed", range(6))
def test_random_reserve_release_matches_occupancy(seed: int) -> None:
    rng = random.Random(seed)
    capacity, align = rng.choice([(1024, 16), (1000, 8), (4096, 64), (333, 1)])
    ring = ByteRing(capacity, align)
    model = Model(capacity)
    wraps = 0
    for rid in range(3000):
        if model.live and rng.random() < 0.45:
            assert ring.release() == model.free()
            continue
        span = ring.span(rng.choice([0, 1, align, 3 * align, rng.randrange(1, capacity // 3)]))
        assert span % align == 0
        largest = ring.largest()
        offset = ring.reserve(span)
        assert (offset is not None) == (span <= largest), "largest() must predict reserve()"
        if offset is None:
            continue
        assert offset % align == 0
        if model.live and offset < model.live[-1][1]:
            wraps += 1
        model.place(rid, offset, span)
        assert ring.live_bytes == sum(s for _, _, s in model.live)
        assert len(ring) == len(model.live)
    assert wraps > 10, "the sequence should have wrapped around many times"


def test_wrap_goes_to_zero_only_when_the_oldest_left_room() -> None:
    ring = ByteRing(100, 2)
    assert [ring.reserve(30), ring.reserve(30), ring.reserve(30)] == [0, 30, 60]
    assert ring.reserve(20) is None  # 10 bytes at the end, and [0, 30) is still live
    ring.release()  # frees [0, 30)
    assert ring.largest() == 30
    assert ring.reserve(20) == 0  # does not split across the end: wraps whole
    assert ring.reserve(20) is None  # only [20, 30) left before the oldest
    assert ring.reserve(10) == 20
    ring.release()
    ring.release()  # the upper part is gone: live bytes are [0, 30)
    assert ring.largest() == 70
    assert ring.reserve(70) == 30


def test_empty_ring_restarts_at_zero_and_takes_its_whole_capacity() -> None:
    ring = ByteRing(128, 16)
    assert ring.reserve(48) == 0
    assert ring.reserve(48) == 48
    ring.release()
    ring.release()
    assert ring.reserve(128) == 0


def test_span_rounds_up_to_the_alignment() -> None:
    ring = ByteRing(1024, 64)
    assert [ring.span(n) for n in (0, 1, 64, 65, 200)] == [0, 64, 64, 128, 256]


@pytest.mark.parametrize(
    ("capacity", "align", "match"),
    [
        (0, 1, "capacity"),
        (-5, 1, "capacity"),
        (True, 1, "capacity"),
        (10.0, 1, "capacity"),
        (64, 0, "align"),
        (64, 24, "power of two"),
    ],
)
def test_bad_ring_arguments_are_rejected(capacity: object, align: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ByteRing(capacity, align)  # type: ignore[arg-type]


def test_release_of_an_empty_ring_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="nothing is reserved"):
        ByteRing(64).release()


def test_engine_records_wrap_whole_and_round_trip() -> None:
    """In the engine: every record's ring slice is in bounds, the ring wraps, and what
    comes out is what went in."""
    sink = MemorySink()
    engine = CaptureEngine(1024, 512, sink, device="cpu", background=False, on_full="block")
    truth, offsets = [], []
    for i in range(60):
        x = torch.full((1 + (i * 37) % 80,), float(i))  # 4..320 bytes, spans of 64..320
        truth.append(x.clone())
        assert engine.capture("x", x)
        rec = engine._queue.peek(len(engine._queue) - 1)  # the record just reserved
        assert rec.offset + rec.span <= 1024 and rec.offset % 64 == 0
        offsets.append(rec.offset)
        if i % 3 == 2:
            engine.poll()
    engine.close()
    assert sum(b < a for a, b in itertools.pairwise(offsets)) >= 5  # wrapped many times
    got = [r.tensor() for r in sink.records]
    assert len(got) == 60 and all(torch.equal(a, b) for a, b in zip(got, truth, strict=True))
