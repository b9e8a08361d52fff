"""CaptureEngine on the CPU: what was captured is what is stored, byte for byte.

Ground truth is a clone of each tensor taken before it is captured, compared byte by
byte (NaN payloads included), never the engine's own output.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from syncless.capture import CaptureEngine, MemorySink
from syncless.capture import open as open_captures
from syncless.guard import no_sync


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in logical (row-major) order."""
    return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bits of ``dtype`` (NaNs and infs included for floats)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    numel = 1
    for n in shape:
        numel *= n
    size = torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen)
    return bits.view(dtype).reshape(shape)


DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float64,
    torch.uint8,
    torch.complex128,  # no safetensors code: stored raw, typed by the index
]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES += [torch.float8_e4m3fn, torch.float8_e5m2]


def cases(gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    out = []
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        out.append((f"{name}/0d", random_tensor(dtype, (), gen)))
        out.append((f"{name}/empty", random_tensor(dtype, (0, 7), gen)))
        out.append((f"{name}/odd", random_tensor(dtype, (3, 5, 7), gen)))
        base = random_tensor(dtype, (12, 10), gen)
        out.append((f"{name}/transposed", base.t()))
        out.append((f"{name}/strided", base[1::3, ::2]))
        out.append((f"{name}/expanded", base[:1].expand(4, 10)))
    z = random_tensor(torch.complex64, (6,), gen)
    out.append(("complex64/conj_view", z.conj()))
    out.append(("float32/neg_view", torch._neg_view(random_tensor(torch.float32, (5,), gen))))
    out.append(("float32/large", random_tensor(torch.float32, (1024, 1024), gen)))  # 4 MiB
    return out


def test_round_trip_is_byte_exact_through_safetensors_and_back(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    captured = cases(gen)
    truth = [(tag, x.clone() if x.numel() else x) for tag, x in captured]
    # Staging is smaller than the large tensor: it goes by an oversized flush.
    with CaptureEngine(16 << 20, 1 << 20, tmp_path, device="cpu") as engine:
        for step, (tag, x) in enumerate(captured):
            assert engine.capture(tag, x, step=step, meta={"i": step, "tag": tag})
    assert engine.counters()["flush_oversized_count"] == 1

    store = open_captures(tmp_path)
    assert len(store) == len(truth)
    for i, (tag, x) in enumerate(truth):
        row = store.rows[i]
        assert (row["tag"], row["step"], row["seq"], row["rank"]) == (tag, i, i, 0)
        assert store.meta(i) == {"i": i, "tag": tag}
        y = store.tensor(i)
        assert y.dtype == x.dtype and y.shape == x.shape, tag
        assert torch.equal(raw(y), raw(x)), tag
        assert row["nbytes"] == x.numel() * x.element_size()


def test_capture_copies_at_capture_time(tmp_path: Path) -> None:
    """The tensor may change right after the capture: the ring holds the value it had."""
    sink = MemorySink()
    with CaptureEngine(1 << 12, 1 << 10, sink, device="cpu", background=False) as engine:
        x = torch.arange(8, dtype=torch.float32)
        engine.capture("x", x)
        x.add_(100)
    assert torch.equal(sink.records[0].tensor(), torch.arange(8, dtype=torch.float32))


def test_hooks_capture_under_no_sync(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    sink = MemorySink()
    engine = CaptureEngine(1 << 20, 1 << 16, sink, device="cpu")
    expected: dict[str, list[torch.Tensor]] = {}

    def forward_hook(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        engine.capture(module.tag, out, step=module.step)  # type: ignore[attr-defined]

    def grad_hook(grad: torch.Tensor) -> None:
        engine.capture("grad/input", grad, step=0, meta={"kind": "grad"})

    for i, layer in enumerate(model):
        layer.tag = f"layer_{i}/out"  # type: ignore[attr-defined]
        layer.step = 0  # type: ignore[attr-defined]
        layer.register_forward_hook(forward_hook)
        layer.register_forward_hook(
            lambda m, a, out: expected.setdefault(m.tag, []).append(out.detach().clone())
        )
    x = torch.randn(5, 8, requires_grad=True)
    x.register_hook(grad_hook)
    x.register_hook(lambda g: expected.setdefault("grad/input", []).append(g.clone()))

    with no_sync(cpu_as_device=True):
        model(x).square().sum().backward()
        engine.advance_boundary()
    engine.close()

    got = {r.tag: r.tensor() for r in sink.records}
    assert set(got) == set(expected)
    for tag, (want,) in expected.items():
        assert torch.equal(got[tag], want), tag
    assert not any(r.tensor().requires_grad for r in sink.records)


def test_flush_stores_everything_captured_so_far() -> None:
    sink = MemorySink()
    engine = CaptureEngine(1 << 16, 1 << 12, sink, device="cpu")
    for i in range(20):
        engine.capture("x", torch.full((3,), float(i)))
    engine.flush()
    assert len(sink.records) == 20
    engine.close()


def test_an_idle_batching_drain_sleeps_until_a_capture_wakes_it() -> None:
    """Without windows the drain thread waits to be told (a capture, a request, staging
    space) instead of polling: it polled every 0.2 ms, thousands of GIL grabs a second
    taken from a host-bound training thread."""
    sink = MemorySink()
    engine = CaptureEngine(1 << 16, 1 << 12, sink, device="cpu", background=True)
    xs = [torch.full((32,), float(i)) for i in range(4)]
    with no_sync(cpu_as_device=True):
        engine.capture("a", xs[0])
    engine.flush()
    before = engine.counters()["drain_loops_count"]
    time.sleep(0.2)
    idle_loops = engine.counters()["drain_loops_count"] - before
    assert idle_loops <= 0.2 / 0.01 + 5  # one look per 10 ms at most (was ~1000)
    with no_sync(cpu_as_device=True):
        for x in xs[1:]:
            engine.capture("a", x)
    deadline = time.monotonic() + 5.0
    while engine.counters()["d2h_count"] < 2 and time.monotonic() < deadline:
        time.sleep(1e-3)  # the captures woke it: no flush asked for these
    assert engine.counters()["d2h_count"] >= 2
    engine.close()
    got = [r.tensor() for r in sink.records]
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, xs, strict=True))
