"""Unconstrained drain throughput of the capture engine vs the D2H bandwidth (issue 7).

No window pattern: the drain batches as fast as it can into a sink that discards the
bytes, so what is measured is the engine's path (ring -> pinned staging on the copy
stream -> writer), not a disk. The reference is the pinned D2H bandwidth measured in
the same process on the same device (one copy of the staging size, median of
``--reps``), with pageable memory for comparison. The target on an H200 is a wall-clock
drain throughput of at least 90% of the pinned bandwidth. Also reported: the copies'
own device throughput (the engine's ``d2h_ms``), and the host cost of one
``capture()`` of a small tensor.

    python -m bench.capture drain                      # H200 defaults: 4 GiB ring, 1 GiB staging
    python -m bench.capture drain --no-record          # CPU: runs, numbers mean nothing
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from bench.capture.host import times_us
from bench.harness import append_result
from syncless.capture import CapturedRecord, CaptureEngine

MiB = 1 << 20


class NullSink:
    """Counts what it is given and keeps nothing."""

    def __init__(self) -> None:
        self.records = 0
        self.nbytes = 0

    def write(self, records: Sequence[CapturedRecord]) -> None:
        self.records += len(records)
        self.nbytes += sum(r.nbytes for r in records)

    def close(self) -> None:
        pass


def timed(fn: Callable[[], None], cuda: bool) -> float:
    """Seconds one call of ``fn`` takes (device time on CUDA)."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def d2h_gbps(device: torch.device, nbytes: int, pinned: bool, reps: int) -> float:
    cuda = device.type == "cuda"
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and cuda)
    times = [timed(lambda: dst.copy_(src, non_blocking=pinned), cuda) for _ in range(reps)]
    return nbytes / statistics.median(times) / 1e9


def drain_run(
    device: torch.device, ring: int, staging: int, record: int, total: int
) -> tuple[float, dict[str, float]]:
    """Capture ``total`` bytes in records of ``record`` bytes (blocking on a full ring);
    seconds from the first capture until the sink has everything, and the counters."""
    sink = NullSink()
    engine = CaptureEngine(ring, staging, sink, device=device, on_full="block")
    x = torch.randn(record // 4, device=device)
    n = total // record
    engine.capture("warmup", x)
    engine.flush()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    before = engine.counters()
    t0 = time.perf_counter()
    for i in range(n):
        engine.capture("x", x, step=i)
    engine.flush()
    seconds = time.perf_counter() - t0
    after = engine.counters()
    engine.close()
    assert sink.records == n + 1 and sum(engine.dropped().values()) == 0
    return seconds, {k: after[k] - before[k] for k in ("d2h_bytes", "d2h_ms", "d2h_count")}


def capture_host_us(device: torch.device, calls: int) -> float:
    """Median host time of one capture() of a 4 KiB tensor into a roomy ring (the
    split of that time: bench/capture/host.py)."""
    engine = CaptureEngine(64 * MiB, 16 * MiB, NullSink(), device=device)
    times = times_us(engine, torch.randn(1024, device=device), calls)
    engine.close()
    return statistics.median(times)


def driver_floor_us(device: torch.device, calls: int) -> float | None:
    """Median host time of the driver call a contiguous CUDA capture makes while the
    drain batches (cuMemcpyDtoDAsync of 4 KiB; the drain records the landing event,
    syncless.capture.ring.landing), without the engine's Python."""
    from syncless.cuda_driver import current_raw_stream, driver

    drv = driver() if device.type == "cuda" else None
    if drv is None or drv.memcpy_fn() is None:
        return None
    memcpy = drv.memcpy_fn()
    src = torch.randn(1024, device=device)
    dst = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    stream = current_raw_stream()
    times = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        memcpy(dst.data_ptr() + (i % 256) * 4096, src.data_ptr(), 4096, stream)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize(device)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ring-mb", type=int, default=4096 if cuda else 64)
    parser.add_argument("--staging-mb", type=int, default=1024 if cuda else 16)
    parser.add_argument("--record-mb", type=float, default=16 if cuda else 1)
    parser.add_argument("--total-gb", type=float, default=16 if cuda else 0.25)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    staging = args.staging_mb * MiB
    record = int(args.record_mb * MiB) // 64 * 64
    pinned = d2h_gbps(device, staging, pinned=True, reps=args.reps)
    pageable = d2h_gbps(device, staging, pinned=False, reps=max(1, args.reps // 2))
    runs = [
        drain_run(device, args.ring_mb * MiB, staging, record, int(args.total_gb * 1e9))
        for _ in range(args.reps)
    ]
    seconds, counts = sorted(runs, key=lambda r: r[0])[len(runs) // 2]  # the median run
    wall = counts["d2h_bytes"] / seconds / 1e9
    on_device = counts["d2h_bytes"] / (counts["d2h_ms"] / 1e3) / 1e9 if counts["d2h_ms"] else 0.0
    host_us = capture_host_us(device, 2000)
    floor = driver_floor_us(device, 2000)
    floor_text = "" if floor is None else f" (its driver copy alone {floor:.1f} us)"
    ratio = wall / pinned
    line = (
        f"unconstrained drain, ring {args.ring_mb} MiB, staging {args.staging_mb} MiB, "
        f"{args.record_mb:g} MiB records, {counts['d2h_bytes'] / 1e9:.2f} GB (median of "
        f"{args.reps}): {wall:.1f} GB/s wall = {ratio:.0%} of pinned D2H {pinned:.1f} GB/s "
        f"(target >= 90%: {'met' if ratio >= 0.9 else 'NOT met'}; pageable {pageable:.1f} "
        f"GB/s); copies on the device {on_device:.1f} GB/s, {int(counts['d2h_count'])} "
        f"transfers; capture() host {host_us:.1f} us/call (4 KiB){floor_text}"
    )
    print(line)
    if not args.no_record:
        append_result("capture_drain", line)
