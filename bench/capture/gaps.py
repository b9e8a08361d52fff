"""Where the capture engine's step cost lands on the GPU: longer kernels, or idle gaps.

``bench/capture/load.py`` measures what the engine costs a GPU-bound step; this says
where. It runs the same model and the same capture mixes (``off``, ``mixed-deferred``,
``torch-copy``, ...) and traces a few steps of each with the CUDA profiler (CUPTI only,
no CPU activity, so the host pays little for the trace). Per step, on the training
stream: the kernels' and copies' time, and the idle time between them, with the gaps
over 50 us apart. A cost in kernel time is the device's (the D2H traffic, the copies
into the ring); a cost in idle time is the host's: the training thread was late to
launch (it waited on the GIL or on a driver lock held by the engine's threads).

    python -m bench.capture gaps                       # one H200, llama-1b
    python -m bench.capture gaps --modes off,mixed      # other capture_load modes
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from functools import partial
from pathlib import Path

import torch

from bench.capture.load import CaptureMode
from bench.harness import append_result, by_name, interleave
from bench.stacks.hf_models import bench_device, build_workload, model_specs, train_step

GAP_US = 50.0


def busy_intervals(trace: dict) -> dict[int, list[tuple[float, float]]]:
    """Per stream, its kernels' and copies' (start, end) in us, sorted."""
    out: dict[int, list[tuple[float, float]]] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in ev:
            stream = ev.get("args", {}).get("stream", -1)
            out.setdefault(stream, []).append((ev["ts"], ev["ts"] + ev["dur"]))
    for spans in out.values():
        spans.sort()
    return out


def stream_summary(spans: list[tuple[float, float]], steps: int) -> dict[str, float]:
    """Busy (union), idle and gap time per step, in ms, over the traced window."""
    busy = idle_gaps = 0.0
    gaps = 0
    end = spans[0][0]
    for s, e in spans:
        if s > end:
            gap = s - end
            if gap > GAP_US:
                gaps += 1
                idle_gaps += gap
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    wall = end - spans[0][0]
    return {
        "wall": wall / steps / 1e3,
        "busy": busy / steps / 1e3,
        "idle": (wall - busy) / steps / 1e3,
        "gap_ms": idle_gaps / steps / 1e3,
        "gaps": gaps / steps,
    }


def trace_mode(work, mode: str, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    cap = None if mode == "off" else CaptureMode(work, mode, args, folder)
    flush = None
    try:
        for step in range(args.warmup):
            flush = None if cap is None else (lambda s=step: cap.flush(s))
            train_step(work, flush=flush)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for step in range(args.warmup, args.warmup + args.steps):
                flush = None if cap is None else (lambda s=step: cap.flush(s))
                train_step(work, flush=flush)
        path = folder / f"{mode}.json"
        prof.export_chrome_trace(str(path))
    finally:
        if cap is not None:
            cap.close({})
    streams = busy_intervals(json.loads(path.read_text()))
    path.unlink()
    # The training stream does the most work.
    main = max(streams, key=lambda s: sum(e - b for b, e in streams[s]))
    return stream_summary(streams[main], args.steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--modes", default="off,mixed-deferred,torch-copy")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--small", type=int, default=16)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--ring-mb", type=int, default=4096)
    parser.add_argument("--staging-mb", type=int, default=1024)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("capture_gaps traces CUDA kernels: it needs a GPU")
    device, _ = bench_device(False)
    spec = model_specs()[args.model]
    work = build_workload(spec, device)
    modes = args.modes.split(",")

    def progress(r: int, traced: dict[str, dict[str, float]], seconds: float) -> None:
        for mode, s in traced.items():
            print(
                f"  round {r} {mode}: wall {s['wall']:.2f} ms/step, busy {s['busy']:.2f}, "
                f"idle {s['idle']:.2f} ({s['gaps']:.0f} gaps > {GAP_US:.0f} us: "
                f"{s['gap_ms']:.2f} ms)"
            )

    with tempfile.TemporaryDirectory(prefix="capture-gaps-") as tmp:
        contestants = {mode: partial(trace_mode, work, mode, args, Path(tmp)) for mode in modes}
        results = by_name(interleave(contestants, args.rounds, after_round=progress))
    parts = []
    for mode in modes:
        med = {k: statistics.median(s[k] for s in results[mode]) for k in results[mode][0]}
        parts.append(
            f"{mode}: wall {med['wall']:.2f} ms/step, busy {med['busy']:.2f}, idle "
            f"{med['idle']:.2f} of which {med['gaps']:.0f} gaps > {GAP_US:.0f} us "
            f"{med['gap_ms']:.2f}"
        )
    line = (
        f"{spec.name} (B {spec.batch} x L {spec.seq_len}), training stream under the CUDA "
        f"profiler, median of {args.rounds} rounds of {args.steps} steps: " + "; ".join(parts)
    )
    print(line)
    if not args.no_append:
        append_result("capture_gaps", line)
