"""CaptureEngine on the CPU: drops counted by reason, close, a dead drain, a failed copy,
and the step records a run gets."""

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
        "changed": 0,
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


def test_counts_stay_exact_with_captures_from_several_threads() -> None:
    # capture() counts on per-thread counters, without a lock, and readers add them up:
    # every thread's calls must be in the totals. (A shared unlocked counter could lose
    # updates on a free-threaded build; with the GIL an attribute's += is not
    # interrupted, so that race cannot be forced here. The tiny switch interval
    # interleaves the threads' calls as finely as it can.)
    import sys
    import threading

    from syncless.guard import no_sync

    sink = MemorySink()
    engine = CaptureEngine(1 << 16, 1 << 14, sink, device="cpu", config=EngineConfig(align=64))
    sizes = {name: 1 + 7 * i for i, name in enumerate("abcd")}  # elements per thread
    calls = 400

    def worker(name: str) -> None:
        x = torch.full((sizes[name],), float(ord(name)))
        for _ in range(calls):
            engine.capture(name, x)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with no_sync():
            threads = [threading.Thread(target=worker, args=(n,)) for n in sizes]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(old)
    engine.close()
    counters = engine.counters()
    assert counters["offered_count"] == calls * len(sizes)
    assert counters["offered_bytes"] == calls * 4 * sum(sizes.values())
    dropped = sum(engine.dropped().values())
    stored = [r for r in sink.records]
    assert counters["captured_count"] == len(stored) == counters["stored_count"]
    assert counters["captured_count"] + dropped == calls * len(sizes)
    assert counters["captured_bytes"] == sum(r.nbytes for r in stored)
    for r in stored:  # each record is its thread's tensor
        assert torch.equal(r.tensor(), torch.full((sizes[r.tag],), float(ord(r.tag))))
    assert counters["capture_host_ms"] > 0


def test_report_gives_the_drains_longest_look_since_the_last_report(monkeypatch) -> None:
    from syncless.capture.drain import DrainWorker
    from syncless.guard import no_sync

    slow_s = 0.05
    original = DrainWorker.step
    slowed = []

    def step(self) -> bool:  # the first look that finds records burns slow_s of CPU
        if not slowed and len(self._queue):
            slowed.append(True)
            begin = time.thread_time()
            while time.thread_time() - begin < slow_s:
                pass
        return original(self)

    monkeypatch.setattr(DrainWorker, "step", step)
    engine = CaptureEngine(1 << 20, 1 << 16, MemorySink(), device="cpu")
    with no_sync():
        engine.capture("x", torch.zeros(16))
    engine.flush()
    first = engine.report(step=0)
    assert slowed
    assert first["capture/self/drain_look_max_ms"] >= slow_s * 1e3
    assert first["capture/self/drain_look_ms"] >= first["capture/self/drain_look_max_ms"]
    assert first["capture/self/drain_loops_count"] >= 1
    with no_sync():
        engine.capture("y", torch.zeros(16))
    engine.flush()
    second = engine.report(step=1)  # the slow look was before the last report
    assert second["capture/self/drain_look_max_ms"] < slow_s * 1e3
    engine.close()
