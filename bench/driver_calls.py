"""Host cost of the CUDA driver calls the capture boundaries and the profiler make, with
the stream idle and with work queued on it (a sleep kernel).

Why: the boundary stamps were ``blocking`` timing events; on the H200 recording one on
a busy stream cost 54 us against 1.8 us for a plain timing event, the bulk of
``advance_boundary``'s host time in the expert-parallel demo (docs/capture.md). And
``capture()`` enqueues one copy per call: the copy rows (``cuMemcpyDtoDAsync`` of
4 KiB, torch's ``copy_``, a bare ``cuLaunchKernel`` of an empty kernel, the getters the
copy path calls) say what its floor is.

    python bench/driver_calls.py          # CUDA only
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable

import torch
from results import append_result  # bench/ is on sys.path as a script

from syncless.cuda_driver import current_raw_stream, current_raw_stream_fn, driver, stream_capturing

# An empty kernel with a copy's three parameters: the host cost of a launch itself.
_NOOP_PTX = b"""
.version 7.0
.target sm_80
.address_size 64
.visible .entry noop(.param .u64 dst, .param .u64 src, .param .u64 n)
{
    ret;
}
\0"""


def noop_launcher(stream: int) -> Callable[[int], object] | None:
    """``cuLaunchKernel`` of ``_NOOP_PTX`` through ``ctypes.PyDLL``, or None."""
    lib = ctypes.PyDLL("libcuda.so.1")
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    if lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(_NOOP_PTX)) != 0:
        return None
    if lib.cuModuleGetFunction(ctypes.byref(function), module, b"noop") != 0:
        return None
    launch = lib.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    words = (ctypes.c_uint64 * 3)(0, 0, 4096)
    params = (ctypes.c_void_p * 3)(*(ctypes.addressof(words) + 8 * i for i in range(3)))
    return lambda i: launch(function, 1, 1, 1, 128, 1, 1, 0, stream, params, None)


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
    # The copy path of capture(): 4 KiB into a 1 MiB ring, as bench/capture_drain.py.
    src = torch.randn(1024, device="cuda")
    ring = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    memcpy, ring_ptr = drv.memcpy_fn(), ring.data_ptr()
    if memcpy is not None:
        calls["memcpy D2D 4 KiB"] = lambda i: memcpy(
            ring_ptr + (i % 256) * 4096, src.data_ptr(), 4096, stream
        )
        batch = drv.memcpy_batch_fn(0)
        dsts = [ring_ptr + j * 4096 for j in range(64)]
        srcs = [src.data_ptr()] * 64
        side = torch.cuda.Stream().cuda_stream  # the driver refuses the legacy stream
        if batch is not None and batch(dsts, srcs, [4096] * 64, side) == 0:
            # One call for 64 copies: the drain's held copies of one look.
            calls["memcpy batch 64 x 4 KiB"] = lambda i: batch(dsts, srcs, [4096] * 64, side)
        else:
            print("cuMemcpyBatchAsync: missing or refused")
    views = [ring[j * 4096 : (j + 1) * 4096].view(torch.float32) for j in range(256)]
    calls["torch copy_ 4 KiB"] = lambda i: views[i % 256].copy_(src)
    noop = noop_launcher(stream)
    if noop is not None:
        calls["launch empty kernel"] = noop
    raw_stream = current_raw_stream_fn(0)
    calls["current raw stream"] = lambda i: raw_stream()
    calls["stream_capturing()"] = lambda i: stream_capturing()
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
