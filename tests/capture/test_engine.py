"""CaptureEngine on the CPU: byte-exact round trips, drop accounting, close, bad configs.

Ground truth is a clone of each tensor taken before it is captured, compared byte by
byte (NaN payloads included), never the engine's own output.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from syncless.capture import (
    CaptureEngine,
    EngineConfig,
    Grant,
    GrantController,
    MemorySink,
    WindowPattern,
)
from syncless.capture import open as open_captures
from syncless.guard import no_sync

ALIGN = 64


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


def test_drop_accounting_under_a_full_ring_is_exact() -> None:
    sink = MemorySink()
    engine = CaptureEngine(
        4096, 1024, sink, device="cpu", background=False, config=EngineConfig(max_records=100)
    )
    x = torch.zeros(16)  # 64 bytes: exactly one aligned slot
    accepted = [engine.capture("x", x) for _ in range(100)]
    assert accepted == [True] * 64 + [False] * 36  # nothing drains: the ring holds 64
    assert not engine.capture("big", torch.zeros(2048))  # 8 KiB > the whole ring
    assert engine.dropped() == {
        "ring_full": 36,
        "records_full": 0,
        "oversized": 1,
        "closed": 0,
        "copy_error": 0,
        "sink_error": 0,
        "drain_error": 0,
    }
    c = engine.counters()
    assert c["dropped_ring_full_bytes"] == 36 * 64
    assert c["dropped_oversized_bytes"] == 8192
    assert c["pending_count"] == 64 and c["ring_used_bytes"] == 4096
    engine.close()
    assert len(sink.records) == 64
    c = engine.counters()
    assert c["offered_count"] == 101 == c["stored_count"] + sum(engine.dropped().values())
    assert c["pending_count"] == 0


def test_records_full_is_its_own_reason() -> None:
    engine = CaptureEngine(
        1 << 16, 1 << 12, MemorySink(), device="cpu", background=False,
        config=EngineConfig(max_records=3),
    )  # fmt: skip
    assert [engine.capture("x", torch.zeros(1)) for _ in range(5)] == [True] * 3 + [False] * 2
    assert engine.dropped()["records_full"] == 2
    engine.close()


def test_close_drains_refuses_and_cannot_be_reopened(tmp_path: Path) -> None:
    sink = MemorySink()
    engine = CaptureEngine(1 << 16, 1 << 12, sink, device="cpu")  # background drain
    for i in range(50):
        assert engine.capture("x", torch.full((4,), float(i)), step=i)
    engine.close()
    assert [r.step for r in sink.records] == list(range(50))  # all stored, in order
    assert sink.closed
    assert engine.closed

    assert engine.capture("late", torch.zeros(4)) is False
    assert engine.dropped()["closed"] == 1
    engine.close()  # idempotent
    engine.flush()  # nothing to do
    for call in (engine.suspend, engine.resume):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    with pytest.raises(RuntimeError, match="cannot be reopened"):
        engine.define_pattern(WindowPattern(2, [(0, 1)]))
    c = engine.counters()
    assert c["offered_count"] == 51 and c["stored_count"] == 50


class BrokenController(GrantController):
    def grant(self, *args: object, **kwargs: object) -> Grant:
        raise RuntimeError("controller bug")


def test_a_dead_drain_drops_and_counts_instead_of_hanging(
    capsys: pytest.CaptureFixture[str],
) -> None:
    engine = CaptureEngine(
        1 << 16, 1 << 12, MemorySink(), device="cpu", on_full="block",
        controller=BrokenController(1 << 12),
    )  # fmt: skip
    engine.define_pattern(WindowPattern(2, [(0, 1)]))
    assert engine.capture("a", torch.zeros(16))
    engine.advance_boundary()  # the window OPENs: the drain asks for a grant and dies
    deadline = time.monotonic() + 10
    while engine.drain_error is None:
        assert time.monotonic() < deadline, "the drain should have died"
        time.sleep(0.001)
    assert engine.capture("b", torch.zeros(16)) is False  # block policy, no hang
    engine.flush()  # returns: nothing will drain
    engine.close()
    assert engine.dropped()["drain_error"] == 2  # "b" refused, "a" lost in the ring
    assert engine.counters()["pending_count"] == 0
    assert "controller bug" in capsys.readouterr().err


def test_poll_is_only_for_inline_engines() -> None:
    engine = CaptureEngine(1 << 12, 1 << 10, MemorySink(), device="cpu")
    with pytest.raises(RuntimeError, match="background=False"):
        engine.poll()
    engine.close()


def test_flush_stores_everything_captured_so_far() -> None:
    sink = MemorySink()
    engine = CaptureEngine(1 << 16, 1 << 12, sink, device="cpu")
    for i in range(20):
        engine.capture("x", torch.full((3,), float(i)))
    engine.flush()
    assert len(sink.records) == 20
    engine.close()


class FailingCopy(torch.Tensor):
    """A tensor whose copy into the ring raises (as a device error would)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is torch.Tensor.copy_:
            raise RuntimeError("copy failed")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_copy_error_is_counted_and_raised() -> None:
    sink = MemorySink()
    engine = CaptureEngine(1 << 12, 1 << 10, sink, device="cpu", background=False)
    assert engine.capture("before", torch.ones(4))
    with pytest.raises(RuntimeError, match="copy failed"):
        engine.capture("bad", torch.zeros(4).as_subclass(FailingCopy))
    assert engine.capture("after", torch.ones(4))
    engine.close()
    assert engine.dropped()["copy_error"] == 1
    assert [r.tag for r in sink.records] == ["before", "after"]  # the void slot is skipped
    assert engine.counters()["offered_count"] == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ring_bytes": 1 << 10, "staging_bytes": 1 << 12}, "staging_bytes .* > ring_bytes"),
        ({"ring_bytes": -1}, "ring_bytes must be an integer >= 64"),
        ({"ring_bytes": 0}, "ring_bytes"),
        ({"ring_bytes": 1.5e6}, "ring_bytes"),
        ({"staging_bytes": True}, "staging_bytes"),
        ({"staging_bytes": 32}, "staging_bytes must be an integer >= 64"),
        ({"on_full": "wait"}, "on_full='wait': expected one of 'drop', 'block', 'flush'"),
        ({"device": "meta"}, "expected a CUDA device or the CPU"),
        ({"device": "nonsense"}, "not a torch device"),
        ({"sink": 42}, "sink must be a CaptureSink"),
        ({"sink": None}, "no sink"),
        ({"config": {"align": 64}}, "config must be an EngineConfig"),
        ({"controller": GrantController(1 << 20)}, r"grants up to 1048576 bytes"),
    ],
)
def test_bad_configs_are_rejected(kwargs: dict, match: str) -> None:
    args = {"ring_bytes": 1 << 16, "staging_bytes": 1 << 12, "sink": MemorySink(), "device": "cpu"}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        CaptureEngine(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_device_without_cuda_is_rejected() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        CaptureEngine(1 << 16, 1 << 12, MemorySink(), device="cuda")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"align": 8}, "align must be an integer >= 16"),
        ({"align": 48}, "power of two"),
        ({"max_records": 0}, "max_records"),
        ({"boundary_pool": 1}, "boundary_pool"),
        ({"poll_interval_s": 0}, "poll_interval_s"),
        ({"late_issue_s": -1.0}, "late_issue_s"),
        ({"shard_bytes": 0}, "shard_bytes"),
        ({"shard_interval_s": float("nan")}, "shard_interval_s"),
    ],
)
def test_bad_engine_config_is_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_bad_captures_are_rejected_with_clear_errors() -> None:
    engine = CaptureEngine(1 << 16, 1 << 12, MemorySink(), device="cpu", background=False)
    x = torch.zeros(3)
    with pytest.raises(ValueError, match=r"expected a torch\.Tensor"):
        engine.capture("x", [1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dense strided"):
        engine.capture("x", torch.eye(3).to_sparse())
    with pytest.raises(ValueError, match="on meta but the engine captures from cpu"):
        engine.capture("x", torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="tag must be a non-empty string"):
        engine.capture("", x)
    with pytest.raises(ValueError, match="step must be an int"):
        engine.capture("x", x, step=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="JSON-serialisable"):
        engine.capture("x", x, meta={"value": torch.ones(1)})
    with pytest.raises(ValueError, match="meta must be a mapping"):
        engine.capture("x", x, meta=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_full='later'"):
        engine.capture("x", x, on_full="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected a WindowPattern"):
        engine.define_pattern([(0, 1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="overlap"):
        engine.define_pattern(WindowPattern(4, [(0, 2), (1, 3)]))
    with pytest.raises(RuntimeError, match="resume\\(\\) called while not suspended"):
        engine.resume()
    engine.close()
    assert engine.counters()["offered_count"] == 0  # refused calls are errors, not records


def test_report_emits_capture_step_records_to_the_run(tmp_path: Path) -> None:
    from syncless.run import Run
    from syncless.run.records import check_metric_name

    with Run(run_dir=tmp_path / "run") as run:
        engine = CaptureEngine(4096, 1024, device="cpu", run=run, background=False)
        for _ in range(70):
            engine.capture("x", torch.zeros(16), step=3)  # 64 fit, 6 dropped
        values = engine.report(step=3)
        assert values["capture/step/offered_count"] == 70
        assert values["capture/step/dropped_ring_full_count"] == 6
        assert values["capture/step/pending_count"] == 64
        assert values["capture/self/capture_host_ms"] > 0
        for name in values:
            check_metric_name(name)
        engine.close(step=4)
        run.flush()
        import pyarrow.parquet as pq

        rows = pq.read_table(tmp_path / "run" / "metrics").to_pylist()
        by = {(r["step"], r["name"]): r["value"] for r in rows}
        assert by[(3, "capture/step/offered_count")] == 70
        assert by[(4, "capture/step/stored_count")] == 64  # the final report, at close
        assert by[(4, "capture/step/pending_count")] == 0
    assert (tmp_path / "run" / "captures").is_dir()  # the run's directory is the default sink


def test_thread_clock_reads_a_workers_cpu_time_from_another_thread() -> None:
    import threading

    from syncless.capture.stats import ThreadClock

    own: dict[str, int] = {}
    go, measured, stop = threading.Event(), threading.Event(), threading.Event()

    def worker() -> None:
        go.wait(5)  # asleep until the clock has its first reading
        begin = time.thread_time_ns()
        x = 0
        while time.thread_time_ns() - begin < 30_000_000:  # 30 ms of CPU
            x += 1
        own["busy"] = time.thread_time_ns() - begin
        measured.set()
        stop.wait(5)  # asleep: no CPU time

    clock = ThreadClock()
    t = threading.Thread(target=worker)
    t.start()
    time.sleep(0.01)
    clock.advance(t)  # from here on
    go.set()
    measured.wait(5)
    busy = clock.advance(t)
    time.sleep(0.05)
    idle = clock.advance(t)
    stop.set()
    t.join()
    if not hasattr(time, "pthread_getcpuclockid"):
        assert busy == idle == 0.0
        return
    assert abs(busy - own["busy"] / 1e6) < 2.0  # the thread's own count, to a ms or two
    assert idle < 2.0
    assert clock.advance(t) == 0.0  # ended
    assert clock.advance(None) == 0.0


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
