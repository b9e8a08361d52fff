"""Where ``capture()``'s host time goes: the engine's Python against its copy.

The median and mean of one 4 KiB ``capture()`` on the current device (the mean carries
the outliers: the drain taking the GIL, a garbage collection): an engine with its
drain and writer threads (as in training), the same with the copy deferred to the drain
(``EngineConfig.defer_copy_below``: the drain's looks take the GIL, so a loop of
nothing but captures, a host-bound worst case, pays for them in the mean), and the
same with the copy skipped; then each of the three inline (``background=False``: no
other Python thread). Inline with the copy skipped is the engine's Python alone; a
mode with threads against the same mode inline is what the engine's threads take from
the training thread; deferred against skipped inline, what holding the tensor costs.

    python -m bench.capture host       # CUDA; on the CPU it runs, numbers mean little
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.harness import append_result
from syncless.capture import CaptureEngine, EngineConfig, MemorySink


def times_us(engine: CaptureEngine, x: torch.Tensor, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        engine.capture("small", x)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return times


def _landed_without_copy(rec, tensor, stream, defer=False, defer_copy=False) -> None:
    """The copier's bookkeeping without its copy: the record counts as landed."""
    rec.landed, rec.mark = rec.event, -1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3072)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(1024, device=device)
    ring, staging = (1 << 30, 256 << 20) if device == "cuda" else (64 << 20, 16 << 20)
    rows = {}
    for name, background, copy, defer in (
        ("threads", True, True, 0),
        ("threads, deferred", True, True, 1 << 20),
        ("threads, copy skipped", True, False, 0),
        ("inline", False, True, 0),
        ("inline, deferred", False, True, 1 << 20),
        ("inline, copy skipped", False, False, 0),
    ):
        # Slots for every call: an inline engine drains nothing while it is timed, and a
        # dropped capture (records_full) would be timed without its copy.
        config = EngineConfig(max_records=2 * (args.calls + 500), defer_copy_below=defer)
        engine = CaptureEngine(
            ring, staging, MemorySink(), device=device, background=background, config=config
        )
        if not copy:
            engine._copier.copy = _landed_without_copy
        times_us(engine, x, 512)  # warm up
        engine.flush()
        times = times_us(engine, x, args.calls)
        rows[name] = (statistics.median(times), statistics.fmean(times))
        dropped = sum(engine.dropped().values())
        engine.close()
        print(
            f"{name:22s} median {rows[name][0]:6.2f} mean {rows[name][1]:6.2f} us, {dropped} dropped"
        )
        if dropped:
            raise SystemExit(f"{name}: {dropped} captures dropped; the medians would mislead")
    text = "; ".join(f"{k} {m:.2f} / {a:.2f}" for k, (m, a) in rows.items())
    result = f"capture() host us, median / mean of {args.calls} (4 KiB): {text}"
    if not args.no_record:
        print(append_result("capture_host", result))
