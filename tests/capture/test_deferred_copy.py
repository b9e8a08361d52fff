"""Deferred copies (``EngineConfig.defer_copy_below``, ``capture(defer=...)``) on the
CPU, where the drain copies a held tensor with a memmove: the stored bytes against a
clone taken at the capture, changes caught by the version counter, the fallbacks to an
immediate copy, and the accounting. Captures run under ``no_sync()``."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from syncless.capture import CaptureEngine, EngineConfig, MemorySink
from syncless.guard import no_sync


def engine(background: bool = False, below: int = 1024, **config) -> CaptureEngine:
    return CaptureEngine(
        1 << 16,
        1 << 14,
        MemorySink(),
        device="cpu",
        background=background,
        config=EngineConfig(defer_copy_below=below, **config),
    )


def stored(e: CaptureEngine) -> dict[str, torch.Tensor]:
    return {r.tag: r.tensor() for r in e.sink.records}


def test_held_tensors_are_stored_with_the_bytes_they_had_at_the_capture() -> None:
    e = engine()
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(7, 5, generator=gen),
        "bf16": torch.randn(33, generator=gen).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (3, 4), generator=gen),
        "bool": torch.rand(17, generator=gen) > 0.5,
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    expected = {tag: t.clone() for tag, t in tensors.items()}
    with no_sync():
        assert all(e.capture(tag, t) for tag, t in tensors.items())
    del tensors  # the records hold them until the drain copies
    e.close()
    got = stored(e)
    assert got.keys() == expected.keys()
    for tag, want in expected.items():
        assert got[tag].dtype == want.dtype and got[tag].shape == want.shape
        assert torch.equal(got[tag], want), tag
    assert [r.tag for r in e.sink.records] == list(expected)  # capture order


def test_a_change_the_version_counter_shows_drops_the_record_as_changed() -> None:
    e = engine()
    x, y = torch.arange(8.0), torch.arange(8.0) * 2
    with no_sync():
        assert e.capture("x", x) and e.capture("y", y)
        x.add_(1)  # before the drain's look: its copy would read the changed bytes
    e.close()
    assert [r.tag for r in e.sink.records] == ["y"]
    assert torch.equal(stored(e)["y"], torch.arange(8.0) * 2)
    c = e.counters()
    assert e.dropped()["changed"] == 1 and c["dropped_changed_bytes"] == 32
    assert c["offered_count"] == 2 and c["captured_count"] == 1 and c["stored_count"] == 1
    assert c["offered_count"] == c["stored_count"] + sum(e.dropped().values())


def test_a_change_racing_the_copys_enqueue_drops_the_record_once_it_lands() -> None:
    """Torch bumps the version right after it enqueues an in-place kernel, with the GIL
    released: the drain's check before its copy can miss a change that then lands
    before the copy. The check after the copy catches it. Here the race is forced:
    the in-place op runs inside the copy call."""
    e = engine()
    x, y = torch.arange(8.0), torch.arange(8.0) * 3
    enqueue = e._copier._held_copy

    def racing_copy(dst: int, src: int, nbytes: int, stream: int) -> int:
        status = enqueue(dst, src, nbytes, stream)
        if src == x.data_ptr():
            x.add_(1)  # the training thread's op, between the copy and the check after it
        return status

    e._copier._held_copy = racing_copy
    with no_sync():
        assert e.capture("x", x) and e.capture("y", y)
    e.close()
    assert [r.tag for r in e.sink.records] == ["y"]
    assert torch.equal(stored(e)["y"], torch.arange(8.0) * 3)
    c = e.counters()
    assert e.dropped()["changed"] == 1 and c["captured_count"] == 1
    assert c["offered_count"] == c["stored_count"] + sum(e.dropped().values())


def test_a_change_after_the_drains_look_does_not_touch_the_record() -> None:
    e = engine()
    x = torch.arange(6.0)
    with no_sync():
        e.capture("x", x)
    e.poll()  # the drain copies it here
    x.mul_(-1)
    e.close()
    assert torch.equal(stored(e)["x"], torch.arange(6.0))
    assert e.dropped()["changed"] == 0


def test_a_write_the_version_counter_misses_is_copied_as_changed() -> None:
    """The contract's hazard, pinned down: ``.data`` writes do not move the version."""
    e = engine()
    x = torch.zeros(4)
    with no_sync():
        e.capture("x", x)
        x.data.fill_(7.0)
    e.close()
    assert torch.equal(stored(e)["x"], torch.full((4,), 7.0))


@pytest.mark.parametrize(
    "why, make, kwargs",
    [
        ("over the threshold", lambda base: base, {}),  # 2 KiB >= 1 KiB
        ("defer=False", lambda base: base[:8], {"defer": False}),
        ("not contiguous", lambda base: base[:16].view(4, 4).t(), {"defer": True}),
        ("conjugate bit", lambda base: torch.complex(base[:4], base[4:8]).conj(), {"defer": True}),
    ],
)
def test_captures_that_are_not_deferred_copy_at_the_call(why, make, kwargs) -> None:
    """Each tensor's storage changes in place right after the capture (a change the
    version counter shows): a held copy would be dropped, an immediate one is stored
    with the bytes of the call."""
    e = engine()
    base = torch.arange(512.0)
    x = make(base)
    want = x.resolve_conj().clone()
    with no_sync():
        assert e.capture("x", x, **kwargs), why
        (x if x.is_conj() else base).zero_()  # the conjugate is its own storage
    assert not torch.equal(x.resolve_conj(), want), why  # the tensor did change
    e.close()
    assert e.dropped()["changed"] == 0, why
    assert torch.equal(stored(e)["x"], want), why


def test_an_inference_tensor_is_copied_at_the_call() -> None:
    e = engine()
    with torch.inference_mode():
        x = torch.arange(8.0)
    with no_sync():
        assert e.capture("x", x, defer=True)
    with torch.inference_mode():
        x.add_(1)  # no version counter to tell: the copy had to be immediate
    e.close()
    assert torch.equal(stored(e)["x"], torch.arange(8.0))


def test_defer_true_holds_a_tensor_over_the_threshold_and_releases_it() -> None:
    e = engine(below=0)  # the config defers nothing
    x = torch.arange(4096.0)  # 16 KiB
    ref = weakref.ref(x)
    with no_sync():
        assert e.capture("x", x, defer=True)
        x.add_(1)  # held, so this change drops it: proof it was deferred
    del x
    e.poll()
    gc.collect()
    assert ref() is None  # the slot let go of the tensor
    e.close()
    assert e.dropped()["changed"] == 1 and e.sink.records == []


def test_defer_must_be_a_bool() -> None:
    e = engine()
    with pytest.raises(ValueError, match="defer must be a bool or None"):
        e.capture("x", torch.zeros(2), defer="yes")  # type: ignore[arg-type]
    e.close()


def test_defer_copy_below_is_checked() -> None:
    with pytest.raises(ValueError, match="defer_copy_below must be an integer >= 0"):
        EngineConfig(defer_copy_below=-1)


def test_a_background_drain_stores_many_small_held_captures_exactly() -> None:
    """Fresh tensors, dropped by the caller at once: the drain thread copies them, in
    batches woken by the held count and the gather interval."""
    e = engine(background=True, gather_interval_s=0.001)
    n = 500
    with no_sync():
        for i in range(n):
            assert e.capture(f"t{i}", torch.full((i % 13 + 1,), float(i)), step=i)
    e.close()
    recs = e.sink.records
    assert [r.step for r in recs] == list(range(n))
    for i, r in enumerate(recs):
        assert torch.equal(r.tensor(), torch.full((i % 13 + 1,), float(i)))
    assert sum(e.dropped().values()) == 0
