"""Capture with recurring windows vs ordinary batching on the expert-parallel demo (issue 7).

Two ranks train the demo with expert parallelism and capture the hidden states of
`--layers` every step (or, `--point moe_input`, the MoE blocks' inputs, right before
their router and token dispatch: where batching's copies meet the all-to-alls) (syncless.demo.capture_tool.CaptureTool), once with ordinary
batching and once with `--capture-windows` (every token all-to-all a critical region,
the drain copying between them). For each mode, on each rank:

* D2H time overlapping the critical regions, on the device timeline: over the profiled
  steps (torch.profiler, CUDA activity), the sum over the engine's device-to-host
  memcpys (those of its copy stream) of their intersection with the union of NCCL
  all-to-all kernels (``SendRecv``);
* step time: the demo's `demo/step/step_ms`, median over the steps after warm-up of
  every round (the modes alternate for `--rounds` rounds: batching, windows, batching,
  ...; the device timeline and byte checks come from each mode's first run);
* host time of `advance_boundary` per step (`capture/self/boundary_host_ms`), the
  price of declaring the windows;
* CPU time per step of the training thread (the whole step, from one step's start to
  the next's; with `--blocking-sync` its waits for the GPU sleep, so this is its host
  work), of the engine's drain and writer threads (`capture/self/drain_cpu_ms`,
  `writer_cpu_ms`) and the drain's iterations: on this host-bound step a worker's GIL
  time can come out of the training thread;
* byte-exactness: every captured tensor against a clone of the same block output taken
  by an independent forward hook (the reference), compared bit for bit.

The issue's target: the overlap falls by >= 97% with windows, every capture byte-exact,
step time no worse than batching.

    python -m bench.capture windows --nproc 2                 # demo large on 2 GPUs
    python -m bench.capture windows --nproc 2 --attribute     # + boundaries without captures
    python -m bench.capture windows --nproc 2 --preset tiny --layers 0,1 --steps 6 --warmup 2 --no-record
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from bench.demo.train_step import add_blocking_sync_flag, blocking_sync
from bench.harness import append_result, metric_values, relaunch
from syncless.capture import open as open_captures
from syncless.demo.capture_tool import CaptureTool, parse_layers
from syncless.demo.config import preset
from syncless.demo.train import run_demo

MODES = ("batching", "windows")


class Reference:
    """Clones each captured block's output at every step (ground truth), and profiles
    the device timeline over steps ``[first, last]``."""

    name = "reference"

    def __init__(self, layers: list[int], first: int, last: int, point: str) -> None:
        self.layers, self.first, self.last, self.point = layers, first, last, point
        self.clones: dict[tuple[str, int], torch.Tensor] = {}
        self.step = 0
        self.prof: profile | None = None
        self.events: list = []

    def attach(self, ctx) -> None:
        for i in self.layers:
            tag, block = f"layer_{i:02d}/{self.point}", ctx.model.layers[i]
            if self.point == "hidden":
                block.register_forward_hook(lambda _m, _a, out, t=tag: self._clone(t, out[0]))
            else:
                block.moe.register_forward_pre_hook(lambda _m, a, t=tag: self._clone(t, a[0]))

    def _clone(self, tag: str, x: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            self.clones[(tag, self.step)] = x.detach().clone()

    def step_begin(self, step: int) -> None:
        self.step = step
        if step == self.first and torch.cuda.is_available():
            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.__enter__()

    def step_end(self, step: int) -> None:
        if step == self.last and self.prof is not None:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.events = [e for e in self.prof.events() if e.device_type.name == "CUDA"]
            self.prof = None

    def close(self) -> None:
        pass


class ThreadCPU:
    """The training thread's CPU time per step, from each step's start to the next's."""

    name = "thread_cpu"

    def __init__(self) -> None:
        self.ms: dict[int, float] = {}
        self._last: tuple[int, int] | None = None

    def attach(self, ctx) -> None:
        pass

    def step_begin(self, step: int) -> None:
        now = time.thread_time_ns()
        if self._last is not None:
            self.ms[self._last[0]] = (now - self._last[1]) / 1e6
        self._last = (step, now)

    def step_end(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


# Per mode and rank, medians over the steps after warm-up of every round: (label, metric
# of the demo's run, or None for the training thread's CPU time).
SERIES = (
    ("step", "demo/step/step_ms"),
    ("advance_boundary host", "capture/self/boundary_host_ms"),
    ("training thread CPU", None),
    ("drain CPU", "capture/self/drain_cpu_ms"),
    ("writer CPU", "capture/self/writer_cpu_ms"),
    ("drain loops", "capture/self/drain_loops_count"),
)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def overlap_ms(events: list) -> tuple[float, float]:
    """(D2H memcpy time inside all-to-all kernels, all D2H memcpy time), in ms, for the
    capture engine's copies: the D2H memcpys of the stream that carries the most D2H
    time (its copy stream). The step's own small D2H copies (a `.tolist()` per MoE
    layer, the loss read) run on the compute stream and are not the engine's to move.
    """
    critical = _union(
        [(e.time_range.start, e.time_range.end) for e in events if "SendRecv" in e.name]
    )
    by_stream: dict = {}
    for e in events:
        if "DtoH" in e.name:
            span = (e.time_range.start, e.time_range.end)
            by_stream.setdefault(getattr(e, "device_resource_id", None), []).append(span)
    if not by_stream:
        return 0.0, 0.0
    d2h = max(by_stream.values(), key=lambda spans: sum(b - a for a, b in spans))
    inside = sum(
        max(0.0, min(b, d) - max(a, c)) for a, b in d2h for c, d in critical if c < b and a < d
    )
    return inside / 1e3, sum(b - a for a, b in d2h) / 1e3


def worker(args: argparse.Namespace) -> None:
    # One process group for every run (run_demo then leaves it alone) and the gather.
    if args.blocking_sync:
        blocking_sync(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    root = Path(args.out)
    rank = dist.get_rank()
    results: dict[str, tuple] = {}
    modes = (*MODES, "boundaries") if args.attribute else MODES
    series: dict[str, dict[str, list[float]]] = {m: {k: [] for k, _ in SERIES} for m in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            # drain: the dispatch docs/capture.md's measurements ran (the default before #38)
            cfg = preset(args.preset, steps=args.steps, expert_parallel=True, log_every=1,
                         ep_splits="drain")  # fmt: skip
            layers = parse_layers(args.layers, cfg.n_layers)
            first = round_ == 0 and mode != "boundaries"
            reference = (
                Reference(layers, args.warmup, args.steps - 2, args.point) if first else None
            )
            # "boundaries": the windows' brackets and boundaries, captures at step 0 only.
            every = args.steps + 1 if mode == "boundaries" else 1
            tool = CaptureTool(
                args.layers, every=every, windows=mode != "batching", point=args.point
            )
            cpu = ThreadCPU()
            run_dir = root / f"{mode}-{round_}"
            tools = [tool, cpu] if reference is None else [tool, cpu, reference]
            run_demo(cfg, run_dir=run_dir, name=mode, quiet=True, tools=tools)
            for label, metric in SERIES:
                if metric is None:
                    values = [v for k, v in sorted(cpu.ms.items()) if k >= args.warmup]
                else:
                    values = metric_values(run_dir, metric, args.warmup, rank)
                series[mode][label] += values
            if reference is not None and mode == "windows" and tool.engine is not None:
                print_window_log(tool.engine, rank, args.warmup, args.steps - 2)
            if reference is not None and rank == 0:
                print(f"{mode} round 0, capture counters over the run, rank 0: "
                      + ", ".join(f"{k} {v:g}" for k, v in counters(run_dir).items()))  # fmt: skip
            if reference is not None:
                exact, n = byte_exact(run_dir, rank, reference)
                inside, total = overlap_ms(reference.events)
                results[mode] = (inside, total, exact, n)
    if args.attribute:
        results["boundaries"] = (float("nan"), float("nan"), True, 0)
    for mode in modes:
        medians = {k: statistics.median(v) if v else 0.0 for k, v in series[mode].items()}
        results[mode] += (medians,)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        report(args, gathered)
    dist.destroy_process_group()


COUNTERS = ("window_grants_count", "window_transfers_count", "window_overruns_count",
            "window_issued_late_count", "window_close_late_count", "window_missed_count",
            "flush_capacity_count", "d2h_window_bytes", "d2h_batch_bytes", "d2h_flush_bytes",
            "boundary_count")  # fmt: skip


def counters(run_dir: Path) -> dict[str, float]:
    """The engine's counters summed over the run, and whether it fell back to batching."""
    out = {k: sum(metric_values(run_dir, f"capture/step/{k}")) for k in COUNTERS}
    out["fallback"] = max(metric_values(run_dir, "capture/step/fallback"), default=0.0)
    return out


def print_window_log(engine, rank: int, first: int, last: int) -> None:
    """Why the windows moved what they moved: the controller's counts over the run, and
    each window transfer that overran in the profiled steps (occurrence k is step k+1:
    step 0 counts the regions and runs without windows)."""
    counts = engine.controller.counts()
    print(f"windows round 0, rank {rank}, controller counts: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))  # fmt: skip
    for r in engine.window_reports():
        if first <= r.occurrence + 1 <= last and not r.before_close:
            window = "?" if r.window_s is None else f"{r.window_s * 1e3:.3f}"
            copy = "?" if r.transfer_s is None else f"{r.transfer_s * 1e3:.3f}"
            print(f"  rank {rank} overrun: step {r.occurrence + 1} position {r.position} "
                  f"{r.moved_bytes} B (budget {r.budget}, probe {r.probe}) copy {copy} ms "
                  f"window {window} ms outcome {r.outcome}")  # fmt: skip


def byte_exact(run_dir: Path, rank: int, reference: Reference) -> tuple[bool, int]:
    """Every capture of this rank equals the reference clone bit for bit; how many."""
    store = open_captures(run_dir)
    mine = [i for i, r in enumerate(store.index.column("rank").to_pylist()) if r == rank]
    tags, steps = store.index.column("tag").to_pylist(), store.index.column("step").to_pylist()
    exact = len(mine) == len(reference.clones) and all(
        torch.equal(
            store.tensor(i).view(torch.uint8),
            reference.clones[(tags[i], steps[i])].cpu().view(torch.uint8),
        )
        for i in mine
    )
    return exact, len(mine)


def _costs(per_rank: list[dict], mode: str) -> str:
    """Each series' median for ``mode``, the largest over the ranks."""
    return ", ".join(
        f"{label} {max(r[mode][4][label] for r in per_rank):.2f}"
        + ("" if label == "drain loops" else " ms")
        for label, _ in SERIES
    )


def report(args: argparse.Namespace, per_rank: list[dict]) -> None:
    parts = []
    for mode in MODES:
        print(f"{mode}: D2H inside all-to-alls per rank "
              + ", ".join(f"{r[mode][0]:.3f} of {r[mode][1]:.2f} ms" for r in per_rank))  # fmt: skip
        inside = max(r[mode][0] for r in per_rank)
        total = max(r[mode][1] for r in per_rank)
        exact = all(r[mode][2] for r in per_rank)
        n = sum(r[mode][3] for r in per_rank)
        parts.append(f"{mode}: D2H inside all-to-alls {inside:.2f} of {total:.2f} ms, "
                     f"{n} captures byte-exact {exact}; per step {_costs(per_rank, mode)}")  # fmt: skip
    base, win = (max(r[m][0] for r in per_rank) for m in MODES)
    cut = (1 - win / base) * 100 if base > 0 else float("nan")
    step_base, step_win = (max(r[m][4]["step"] for r in per_rank) for m in MODES)
    if not step_base > 0:
        raise SystemExit(
            f"no step measured: --steps {args.steps} leaves none after --warmup {args.warmup}"
        )
    sync = ", blocking sync" if args.blocking_sync else ""
    line = (f"demo {args.preset} EP 2{sync}, {args.point} of layers {args.layers} every step, {args.rounds} "
            f"alternating rounds of {args.steps} steps, medians over steps >= {args.warmup}, "
            f"profiled steps {args.warmup}..{args.steps - 2} of round 0: "
            + "; ".join(parts)
            + f"; overlap cut by windows {cut:.1f}% (target >= 97%); step windows vs "
            f"batching {(step_win / step_base - 1) * 100:+.1f}% (target <= 0)")  # fmt: skip
    if "boundaries" in per_rank[0]:
        step_b = max(r["boundaries"][4]["step"] for r in per_rank)
        line += (f"; boundaries and brackets alone (no captures after step 0): "
                 f"{(step_b / step_base - 1) * 100:+.1f}% vs batching, per step "
                 f"{_costs(per_rank, 'boundaries')}")  # fmt: skip
    print(line)
    if not args.no_record:
        append_result("capture_windows", line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--preset", default="large")
    parser.add_argument("--layers", default="0,11,23", help="captured layers (all, or a list)")
    parser.add_argument(
        "--point",
        default="hidden",
        choices=("hidden", "moe_input"),
        help="what is captured of each layer (the demo's --capture-point): moe_input is "
        "right before the router and the token dispatch",
    )
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument(
        "--attribute",
        action="store_true",
        help="also run the windows' boundaries and brackets without captures, to split "
        "the windows' step-time cost between them and the copies",
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per mode")
    parser.add_argument("--warmup", type=int, default=12, help="steps before the profiled ones")
    add_blocking_sync_flag(parser)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as out:
        sys.exit(relaunch(__name__, args.nproc, argv, "--out", out))
