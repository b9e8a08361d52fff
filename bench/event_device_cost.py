"""What an event record costs the GPU (not the host) between back-to-back kernels.

A span edge of the events profiler is one timing event record on the stream. Its host
cost is in bench/profile_mark_cost.py; this measures its device cost: the stream is
held by a sleep kernel while ``n`` kernels are queued behind it, each followed (or
not) by an event record, so the device time between the sleep's end and the last
kernel is the kernels' and the records' alone, free of host launch gaps. Per record
cost = (with records - without) / n, for a tiny kernel (a 1-element add) and a
1024x1024 bf16 matmul, with timing events and with timing disabled.

    python bench/event_device_cost.py --n 400
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from results import append_result  # bench/ is on sys.path as a script


def device_ms(n: int, kernel: Callable[[], object], events: list[torch.cuda.Event] | None) -> float:
    """Device ms from the sleep's end to the last of ``n`` kernels (each followed by
    ``events[i].record()`` when given)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(50_000_000)  # ~25 ms: every launch below queues behind it
    begin.record()
    for i in range(n):
        kernel()
        if events is not None:
            events[i].record()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=400, help="kernels per measurement")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("event_device_cost needs a CUDA device")
    tiny = torch.zeros(1, device="cuda")
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    kernels = {"tiny add": lambda: tiny.add_(1), "matmul 1024 bf16": lambda: a @ a}
    timing = [torch.cuda.Event(enable_timing=True) for _ in range(args.n)]
    plain = [torch.cuda.Event(enable_timing=False) for _ in range(args.n)]
    cells = []
    for name, kernel in kernels.items():
        for _ in range(2):  # warm-up: creates the events, tunes the matmul
            for events in (None, timing, plain):
                device_ms(args.n, kernel, events)
        runs: dict[str, list[float]] = {"none": [], "timing": [], "plain": []}
        for _ in range(args.repeats):
            for label, events in (("none", None), ("timing", timing), ("plain", plain)):
                runs[label].append(device_ms(args.n, kernel, events))
        base = statistics.median(runs["none"]) * 1e3 / args.n
        per_timing = (statistics.median(runs["timing"]) * 1e3 / args.n) - base
        per_plain = (statistics.median(runs["plain"]) * 1e3 / args.n) - base
        cells.append(
            f"{name} ({base:.2f} us/kernel): timing record {per_timing:+.2f} us, "
            f"no-timing record {per_plain:+.2f} us"
        )
        print(cells[-1])
    text = (
        f"device us added per event record between back-to-back kernels (n {args.n}, median "
        f"of {args.repeats}): " + "; ".join(cells)
    )
    print(text)
    if not args.no_record:
        append_result("event_device_cost", text)


if __name__ == "__main__":
    main()
