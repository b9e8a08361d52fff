"""Capture under real load: every layer's hidden state, every step, of a GPU-bound model.

Issue 23. Three measurements in one process:

1. **The disk** (bench/capture/disk.py). What the sink's directory takes: sequential
   writes of shard-sized files from pinned memory, timed until written (the page cache)
   and until on disk (``os.sync``), by one writer and by a pool. The synced rate is what
   the sink can sustain for hours; the page cache only absorbs bursts.
2. **The engine into that disk.** Unconstrained (no training): records of the
   hidden-state size captured back to back (``on_full="block"``) into the default
   safetensors sink, timed until the sink has everything and until it is synced,
   against min(pinned D2H, disk).
3. **Training.** A Hugging Face model built from its config (bench/stacks/hf_models.py,
   default llama-1b: 16 layers, B 4 x L 2048; under bf16 autocast over float32
   parameters the residual stream is float32, 64 MiB per layer, 1 GiB per step),
   interleaved A/B segments (bench/stacks/segments.py) of ``off`` against: ``null`` (every
   layer into a sink that discards: the D2H path and the engine's threads alone),
   ``disk-1`` (every layer into the safetensors sink, one writer), ``disk``
   (``--writers`` writers), ``disk-quarter`` (every fourth layer: a rate near what the
   disk sustains), ``mixed`` (every layer plus 16 rows of 4 KiB per layer, 256
   small captures and 16 large per step, into the null sink), ``mixed-deferred`` (the
   same, the small rows' copies deferred to the drain) and ``mixed-all-deferred``
   (every copy deferred); and a reference without the engine, ``torch-copy`` (the
   mix's tensors copied with torch's ``copy_`` into preallocated device buffers: no
   D2H, no threads), which shows what any enqueue of these sizes costs the host at
   that point of a GPU-bound step, and what the device-to-device copies alone cost the
   step. Per mode: the step's overhead, the rate offered and stored, drops, the engine threads'
   CPU time, and ``capture()``'s host time per call, small and large apart.

    python -m bench.capture load                          # one H200
    python -m bench.capture load --tiny --no-append      # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.capture.disk import disk_stage
from bench.capture.drain import NullSink
from bench.capture.gc_clock import GcClock
from bench.harness import append_result, round_overheads
from bench.stacks.hf_models import bench_device, build_workload, model_specs, throughput, tiny
from bench.stacks.segments import ModelState, Segment, measure
from syncless.capture import CaptureEngine, EngineConfig, SafetensorsSink

MiB = 1 << 20
MODES = (
    "off",
    "null",
    "disk-1",
    "disk",
    "disk-quarter",
    "mixed",
    "mixed-deferred",
    "mixed-all-deferred",
    "torch-copy",
)
# Copies left to the drain (EngineConfig.defer_copy_below): mixed-deferred, the small
# rows' (the hidden states, 64 MiB each, are copied at the call); mixed-all-deferred,
# every one.
DEFER_BELOW = {"mixed-deferred": 64 << 10, "mixed-all-deferred": 1 << 62}
# Per capture call: wall time, and the training thread's CPU time over the same call
# (where they part, the call waited: for the GIL, or in a driver call for queue space).
TIMES = ("large", "large_cpu", "small", "small_cpu")


def thread_ns() -> int:
    return time.thread_time_ns() if _THREAD_CLOCK else 0


# False skips the clock: it was ruled out as a cost of its own (bench/RESULTS.md, 715f87e).
_THREAD_CLOCK = True


class CaptureMode:
    """One segment's engine and hooks: every layer's output, maybe small rows too."""

    def __init__(self, work, mode: str, args: argparse.Namespace, folder: Path) -> None:
        self.folder = folder
        mixed = mode.startswith("mixed") or mode == "torch-copy"
        sink = NullSink() if mode == "null" or mixed else SafetensorsSink(folder)
        writers = 1 if mode == "disk-1" else args.writers
        defer = DEFER_BELOW.get(mode, 0)
        engine_settings = {
            "gather_bytes": args.gather_mb * MiB if args.gather_mb else None,
            "gather_interval_s": args.gather_s,
        }
        config = EngineConfig(
            writers=writers,
            defer_copy_below=defer,
            **{k: v for k, v in engine_settings.items() if v is not None},
        )
        self.engine = CaptureEngine(args.ring_mb * MiB, args.staging_mb * MiB, sink, config=config)
        # torch-copy: the engine stays idle (its counters read zero); the hooks copy.
        self.copy = self._torch_copy if mode == "torch-copy" else self.engine.capture
        self.buffers: dict[tuple, torch.Tensor] = {}
        every = 4 if mode == "disk-quarter" else 1
        self.small = args.small if mixed else 0
        self.times: dict[str, list[float]] = {k: [] for k in TIMES}
        self.step = 0
        self.hook_at: list[int] = []
        self.last_flush = 0
        self.phases: list[tuple[float, ...]] = []
        self.hooks = [
            layer.register_forward_hook(self._hook(i))
            for i, layer in enumerate(work.layers)
            if i % every == 0
        ]
        self.before = self.engine.counters()
        self.start = time.perf_counter()

    def _torch_copy(self, tag: str, x: torch.Tensor, step: int) -> bool:
        key = (tuple(x.shape), x.dtype)
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.empty_like(x)
        buf.copy_(x)
        return True

    def _hook(self, index: int):
        tag = f"layer_{index:02d}/hidden"
        small_tag = f"{tag}/row"

        def hook(_module, _args, out) -> None:
            hidden = out[0] if isinstance(out, tuple) else out
            if index == 0 and not self.times["large"]:  # which copy path it can take
                print(
                    f"  large capture: {tuple(hidden.shape)} {hidden.dtype}, contiguous "
                    f"{hidden.is_contiguous()}, requires_grad {hidden.requires_grad}"
                )
            c0, t0 = thread_ns(), time.perf_counter_ns()
            self.hook_at.append(t0)
            self.copy(tag, hidden, step=self.step)
            self.times["large"].append((time.perf_counter_ns() - t0) / 1e3)
            self.times["large_cpu"].append((thread_ns() - c0) / 1e3)
            rows = [hidden[0, row] for row in range(self.small)]  # sliced outside the timing
            for row in rows:
                c0, t0 = thread_ns(), time.perf_counter_ns()
                self.copy(small_tag, row, step=self.step)
                self.times["small"].append((time.perf_counter_ns() - t0) / 1e3)
                self.times["small_cpu"].append((thread_ns() - c0) / 1e3)

        return hook

    def flush(self, step: int) -> None:
        self.step = step + 1
        # Where the host was in the step: its first and last large capture, and this
        # flush (after the optimizer's enqueue), from the previous flush on.
        now = time.perf_counter_ns()
        if self.hook_at and self.last_flush:
            self.phases.append(
                tuple((t - self.last_flush) / 1e6 for t in (self.hook_at[0], self.hook_at[-1], now))
            )
        self.hook_at.clear()
        self.last_flush = now

    def close(self, totals: dict[str, list[float]]) -> None:
        seconds = time.perf_counter() - self.start
        # Brings the threads' CPU time into the counters; the drain's longest look in
        # the segment is about the longest the training thread can have waited on it.
        look_max = self.engine.report(0)["capture/self/drain_look_max_ms"]
        during = self.engine.counters()
        for h in self.hooks:
            h.remove()
        self.engine.close()
        shutil.rmtree(self.folder / "captures", ignore_errors=True)
        delta = {k: during[k] - self.before[k] for k in during}
        totals.setdefault("seconds", []).append(seconds)
        # Rates over the segment (what stays behind is stored by close(), untimed).
        for key in ("offered_bytes", "stored_bytes", "drain_cpu_ms", "writer_cpu_ms"):
            totals.setdefault(key, []).append(delta[key])
        totals.setdefault("dropped", []).append(sum(self.engine.dropped().values()))
        totals.setdefault("look_max_ms", []).append(look_max)
        totals.setdefault("phases", []).extend(self.phases)
        for kind, values in self.times.items():
            totals.setdefault(f"host_{kind}", []).extend(values)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def run_training(args: argparse.Namespace, device, matmul, folder: Path) -> list[str]:
    spec = model_specs()[args.model]
    spec = tiny(spec) if args.tiny else spec
    if args.layers:
        spec = dataclasses.replace(spec, layers=args.layers)
    work = build_workload(spec, device)
    state = ModelState(work=work, budget=0.01)
    totals: dict[str, dict[str, list[float]]] = {m: {} for m in args.modes}

    gc_clock = GcClock()

    def open_segment(mode: str, _state) -> Segment:
        gc_clock.key = mode
        if mode == "off":
            return Segment()
        cap = CaptureMode(work, mode, args, folder)
        return Segment(flush=cap.flush, close=lambda: cap.close(totals[mode]))

    with gc_clock.installed():
        rounds, failed = measure(
            state,
            list(args.modes),
            open_segment,
            lambda mode: (args.warmup, args.seg),
            args.rounds,
            time.perf_counter() + args.budget_s,
        )
    steps = {m: len(rounds) * (args.warmup + args.seg) for m in args.modes}
    off = [t for r in rounds for t in r.get("off", [])]
    head = f"{spec.name} ({spec.layers} layers, B {spec.batch} x L {spec.seq_len}), "
    head += throughput(work, statistics.median(off), matmul)
    head += f" (Python GC: {gc_clock.per_step('off', steps['off'])})"
    lines = []
    for mode in args.modes:
        if mode == "off":
            continue
        if mode in failed:
            lines.append(f"{head}; {mode}: failed ({failed[mode]})")
            continue
        o = round_overheads(rounds, mode)
        t = totals[mode]
        secs = sum(t["seconds"])
        text = (
            f"{head}; {mode}: step {statistics.median(o) * 100:+.2f}% "
            f"[{min(o) * 100:+.2f}..{max(o) * 100:+.2f}] ({len(o)} rounds); offered "
            f"{sum(t['offered_bytes']) / secs / 1e9:.2f} GB/s, stored "
            f"{sum(t['stored_bytes']) / secs / 1e9:.2f} GB/s, dropped {int(sum(t['dropped']))}; "
            f"drain CPU {sum(t['drain_cpu_ms']) / secs / 10:.1f}%, writer CPU "
            f"{sum(t['writer_cpu_ms']) / secs / 10:.1f}% of a core, its longest look "
            f"{max(t['look_max_ms']):.2f} ms; capture() host us/call "
            f"large median {statistics.median(t['host_large']):.1f} "
            f"p99 {pct(t['host_large'], 99):.1f} (CPU median "
            f"{statistics.median(t['host_large_cpu']):.1f})"
        )
        if t.get("host_small"):
            text += (
                f", small median {statistics.median(t['host_small']):.1f} "
                f"p99 {pct(t['host_small'], 99):.1f} (CPU median "
                f"{statistics.median(t['host_small_cpu']):.1f})"
            )
        text += f"; Python GC {gc_clock.per_step(mode, steps[mode])}"
        if t.get("phases"):
            first, last, flush = (statistics.median(p[i] for p in t["phases"]) for i in range(3))
            text += (
                f"; the host, from the previous step's flush: first large capture at "
                f"{first:.1f} ms, last {last:.1f}, flush {flush:.1f}"
            )
        lines.append(text)
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seg", type=int, default=16)
    parser.add_argument("--small", type=int, default=16, help="4 KiB rows per layer (mixed)")
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--ring-mb", type=int, default=4096)
    parser.add_argument("--staging-mb", type=int, default=1024)
    parser.add_argument("--disk-gb", type=float, default=12.0)
    parser.add_argument("--dir", default=None, help="where the sink writes (default: a temp dir)")
    parser.add_argument("--skip-disk", action="store_true")
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (the model's own)")
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--gather-mb", type=int, default=None, help="EngineConfig.gather_bytes")
    parser.add_argument(
        "--gather-s", type=float, default=None, help="EngineConfig.gather_interval_s"
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run (seconds; CPython's default is 0.005)",
    )
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        # How long a thread that wants the GIL waits before it forces a switch: if the
        # engine's cost moves with it, the training thread waits on the GIL.
        sys.setswitchinterval(args.switch_interval)
    args.modes = args.modes.split(",")
    if args.tiny:
        args.ring_mb, args.staging_mb, args.disk_gb = 64, 16, 0.25
    device, matmul = bench_device(args.tiny)
    folder = Path(tempfile.mkdtemp(prefix="capture-load-", dir=args.dir))
    lines = []
    try:
        if not args.skip_disk:
            lines.append(disk_stage(args, device, folder))
            print(lines[-1], flush=True)
        lines += run_training(args, device, matmul, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for line in lines:
        print(line)
        if not args.no_append:
            append_result("capture_load", line)
