"""How long the engine's threads keep the training thread from the GIL.

Every torch op lets go of the GIL and takes it back when it returns; while the drain or
a writer runs Python, the training thread waits there. On a GPU-bound step that wait
is hidden while the host is ahead of the device, and costs step time where it is not
(after a sync, at the start of a step). This times a training thread's small ops
(50 per "layer", each one launch) between the captures of a mix like
``bench/capture/load.py``'s (per layer, one large tensor and 16 rows of 4 KiB), without
the engine, with immediate copies and with deferred ones, and reports the op times'
tail and the time per step spent in waits over 100 us, with the drain's longest look
(``capture/self/drain_look_max_ms``).

    python -m bench.capture gil                  # the current device
    python -m bench.capture gil --writers 1      # one sink writer thread instead of 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.capture.drain import NullSink
from bench.harness import append_result
from syncless.capture import CaptureEngine, EngineConfig

MiB = 1 << 20
OPS_PER_LAYER = 50
LAYERS = 16
ROWS = 16


def run_steps(engine: CaptureEngine | None, big: torch.Tensor, steps: int) -> list[float]:
    """Per op, its host time (us), over ``steps`` steps of ``LAYERS`` layers."""
    a = torch.randn(64, device=big.device)
    b = torch.empty_like(a)
    rows = [big[0, i] for i in range(ROWS)]
    times = []
    for step in range(steps):
        for _ in range(LAYERS):
            if engine is not None:
                engine.capture("hidden", big, step=step)
                for row in rows:
                    engine.capture("row", row, step=step)
            for _ in range(OPS_PER_LAYER):
                t0 = time.perf_counter_ns()
                torch.add(a, 1, out=b)
                times.append((time.perf_counter_ns() - t0) / 1e3)
        if big.is_cuda:
            torch.cuda.synchronize()  # a step's end: the host is not ahead any more
    return times


def summary(times: list[float], steps: int) -> str:
    ordered = sorted(times)
    n = len(ordered)
    waits = sum(t for t in ordered if t > 100) / 1e3 / steps
    return (
        f"op median {statistics.median(ordered):.1f} us, p99 {ordered[int(n * 0.99)]:.1f}, "
        f"p99.9 {ordered[int(n * 0.999)]:.1f}, max {ordered[-1]:.0f}; waits over 100 us "
        f"{waits:.2f} ms/step"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--big-mb", type=int, default=16, help="the large capture per layer")
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # [n, ROWS, 1024] float32: big[0, i] is one 4 KiB row.
    big = torch.randn(args.big_mb * MiB // (ROWS * 1024 * 4), ROWS, 1024, device=device)
    parts = [f"without the engine: {summary(run_steps(None, big, args.steps), args.steps)}"]
    ring, staging = (4096 * MiB, 1024 * MiB) if device == "cuda" else (512 * MiB, 128 * MiB)
    for name, defer in (("immediate", 0), ("deferred", 64 << 10)):
        config = EngineConfig(writers=args.writers, defer_copy_below=defer)
        engine = CaptureEngine(ring, staging, NullSink(), device=device, config=config)
        run_steps(engine, big, 5)  # warm up
        engine.report(0)
        times = run_steps(engine, big, args.steps)
        look = engine.report(1)["capture/self/drain_look_max_ms"]
        dropped = sum(engine.dropped().values())
        engine.close()
        parts.append(f"{name}: {summary(times, args.steps)}, longest drain look {look:.2f} ms")
        if dropped:
            parts[-1] += f", {dropped} dropped"
        print(parts[-1])
    print(parts[0])
    result = (
        f"training thread's op times between captures ({LAYERS} layers x ({args.big_mb} MiB + "
        f"{ROWS} rows of 4 KiB) per step, {OPS_PER_LAYER} ops per layer, {args.steps} steps, "
        f"NullSink with {args.writers} writers): " + "; ".join(parts)
    )
    if not args.no_record:
        print(append_result("capture_gil", result))
