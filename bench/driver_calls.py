"""Host cost of the CUDA driver calls the capture boundaries and the profiler make, with
the stream idle and with work queued on it (a sleep kernel).

Why: the boundary stamps were ``blocking`` timing events; on the H200 recording one on
a busy stream cost 54 us against 1.8 us for a plain timing event, the bulk of
``advance_boundary``'s host time in the expert-parallel demo (docs/capture.md).

    python bench/driver_calls.py          # CUDA only
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from results import append_result  # bench/ is on sys.path as a script

from syncless.cuda_driver import current_raw_stream, driver

CALLS = 1000
BUSY_CYCLES = 100_000_000  # ~55 ms of sleep kernel: longer than the CALLS calls


def per_call_us(fn: Callable[[int], object], busy: bool, repeats: int = 5) -> float:
    """Median over ``repeats`` of the host time of one call, stream idle or busy."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(BUSY_CYCLES)
        start = time.perf_counter_ns()
        for i in range(CALLS):
            fn(i)
        times.append((time.perf_counter_ns() - start) / CALLS / 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    drv = driver()
    if drv is None:
        raise SystemExit("bench/driver_calls.py needs CUDA and libcuda")
    stream = current_raw_stream(0)
    record, write = drv.record_fn(), drv.write_fn()
    device_words = torch.zeros(2, dtype=torch.int64, device="cuda")
    host_word = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    host_address = drv.host_device_pointer(host_word)
    pair = drv.write_pair_fn(device_words.data_ptr(), host_address)
    events: list[list[torch.cuda.Event]] = []  # the CUevents live as long as these

    def recorder(**flags: bool) -> Callable[[int], object]:
        pool = [torch.cuda.Event(**flags) for _ in range(64)]
        for ev in pool:
            ev.record()  # torch creates the CUevent at its first record
        events.append(pool)
        handles = [ev.cuda_event for ev in pool]
        return lambda i: record(handles[i % 64], stream)

    calls: dict[str, Callable[[int], object]] = {
        "record timing": recorder(enable_timing=True),
        "record timing+blocking": recorder(enable_timing=True, blocking=True),
        "record no timing": recorder(),
        "write device": lambda i: write(stream, device_words.data_ptr(), i, 0),
        "write pinned host": lambda i: write(stream, host_address, i, 0),
    }
    if pair is not None:
        calls["pair (device, host)"] = lambda i: pair(stream, i, i)
    parts = []
    for name, fn in calls.items():
        idle, busy = per_call_us(fn, False), per_call_us(fn, True)
        print(f"{name:24s} idle {idle:6.2f} us/call, busy {busy:6.2f} us/call")
        parts.append(f"{name} {idle:.2f} / {busy:.2f}")
    append_result(
        "driver_calls",
        f"host us per driver call, stream idle / busy (median of 5 x {CALLS}): " + "; ".join(parts),
    )


if __name__ == "__main__":
    main()
