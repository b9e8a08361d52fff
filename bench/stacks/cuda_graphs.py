"""What CUDA graphs buy on real training steps, and what syncless costs inside them (#45).

torchtitan captures each step's forward and backward in a CUDA graph by default: call 1
runs eager on a side stream, call 2 captures and replays, later calls replay. The
optimizer steps outside the graph and the gradients are zeroed in place. This bench runs
that loop on torchtitan's llama3 and MoE models and a Hugging Face Llama (built from
configs, random weights, no download), at a launch-bound shape (B 1 x L 1024) and a
GPU-bound one. In one process per model and shape, in interleaved rounds:

- ``graphs``: eager steps against graphed ones, nothing attached (what graphs buy);
- ``stack``: the default monitor stack (``build("all")``, budget 1%) in a graph of its
  own, against the graph captured without syncless (target: at most +1%);
- ``alarm``: the nonfinite monitor alone, likewise (target: at most +0.3%).

    PYTHONPATH=.wheels/site:. python -m bench.stacks cuda_graphs   # one H100/H200, ~7 min
    python -m bench.stacks cuda_graphs --smoke     # CPU: tiny shapes, StandInGraph, no append

The GPU image has no torchtitan. .wheels/site (git-ignored) holds torchtitan 0.3.0 and
what its model classes import, unpacked from pure-Python wheels: ``pip download
--no-deps --python-version 3.12 --only-binary=:all: -d .wheels torchtitan==0.3.0
tyro==1.0.17 docstring_parser==0.18.0 spmd_types==0.2.3``, then ``python -m zipfile -e``
each into .wheels/site.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from bench.harness import Rounds, append_result, interleave, round_overheads, round_ratios, spread
from bench.stacks.hf_models import (
    H200_BF16_PEAK,
    ModelSpec,
    Workload,
    bench_device,
    build_workload,
    free_memory,
    model_specs,
    params_text,
    step_loss,
    throughput,
    write_json,
)
from bench.stacks.hf_models import tiny as tiny_hf
from bench.stacks.segments import verdict
from bench.stacks.stack_models import TITAN_LLAMA, TITAN_MOE, build_titan
from bench.stacks.stack_models import tiny as tiny_titan
from bench.stacks.titan_models import without_fsdp_helpers
from syncless.graphs import StandInGraph
from syncless.monitors import MonitorHandle, attach, build
from syncless.run.records import StepRecords

CAUSAL_SDPA = "sdpa_is_causal"
STACK_TARGET = 0.01  # issue #45: the default stack inside a graph costs at most 1%
ALARM_TARGET = 0.003  # the nonfinite alarm alone, at most 0.3%
PHASES = ("graphs", "stack", "alarm")
PHASE_WEIGHTS = {"graphs": 1.0, "stack": 2.0, "alarm": 2.0}  # shares of a case's time


@dataclass(frozen=True)
class Case:
    """One model at one shape."""

    key: str
    spec: ModelSpec
    build: Callable[[ModelSpec, torch.device], Workload]
    stack: str
    """Whose model classes, for the RESULTS line."""
    weight: float
    """Its share of the time left, against the other cases' weights."""


def build_hf(spec: ModelSpec, device: torch.device) -> Workload:
    """bench/stacks/hf_models' model, its attention SDPA with ``is_causal`` under a name that
    transformers builds no mask for.

    With ``"sdpa"``, transformers 5.24 checks ``position_ids`` for packed sequences in
    every forward (``find_packed_sequence_indices``): eager, the check reads the device
    (a sync); under capture it cannot, so it builds a full boolean mask, which takes
    SDPA off FlashAttention. Eager and graphed steps would then run different kernels.
    """
    work = build_workload(spec, device)
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
        work.model.set_attn_implementation(CAUSAL_SDPA)
    except (ImportError, AttributeError, ValueError) as e:
        print(f"  {spec.name}: attention stays sdpa ({e!r}); a capture may fail or mask")
    return work


def attention_of(work: Workload) -> str:
    config = getattr(work.model, "config", None)
    return str(getattr(config, "_attn_implementation", None) or "sdpa")


def cases(smoke: bool) -> dict[str, Case]:
    """Every case by key, in the order they run: the GPU-bound llama3 shapes first (the
    stack's target is judged there), the torchtitan MoE at its larger shape last (the
    most memory: if it fails, nothing runs after it)."""
    hf_llama = model_specs()["llama-1b"]
    # B 8 x L 4096 (stack_models) holds ~34 GB of activations per step: two graphs' pools
    # and the parameters with AdamW's state would not fit an 80 GB H100.
    moe = replace(TITAN_MOE, batch=4, seq_len=4096)
    builders = {"torchtitan": build_titan, "transformers": build_hf}

    def case(spec: ModelSpec, stack: str, launch_bound: bool, weight: float) -> Case:
        if smoke:
            spec = (tiny_titan if stack == "torchtitan" else tiny_hf)(spec)
        if launch_bound:
            spec = replace(spec, batch=1, seq_len=spec.seq_len if smoke else 1024)
        key = f"{spec.name}:B{spec.batch}xL{spec.seq_len}"
        return Case(key, spec, builders[stack], stack, weight)

    # Weights: the cases #45 needs (the GPU-bound llama3s, one launch-bound shape) get
    # the most time; the first also pays for compiling syncless's kernels.
    order = [
        case(TITAN_LLAMA, "torchtitan", False, 1.6),
        case(hf_llama, "transformers", False, 1.6),
        case(TITAN_LLAMA, "torchtitan", True, 0.7),
        case(hf_llama, "transformers", True, 0.5),
        case(moe, "torchtitan", True, 0.5),
        case(moe, "torchtitan", False, 1.1),
    ]
    return {c.key: c for c in order}


def graph_backend(device: torch.device) -> str:
    """``torchtitan`` (its ``CUDAGraphWrapper``), ``cuda`` (the same pattern here, where
    torchtitan does not import) or ``stand-in`` (a CPU: syncless.graphs.StandInGraph)."""
    if device.type != "cuda":
        return "stand-in"
    try:
        without_fsdp_helpers()
        from torchtitan.distributed import cudagraph

        if not hasattr(cudagraph._manager, "_graph_pool"):
            raise AttributeError("no _CUDAGraphManager._graph_pool to give each graph a pool")
        return "torchtitan"
    except Exception as e:
        print(f"torchtitan's CUDAGraphWrapper is not usable ({e!r}): its pattern, here")
        return "cuda"


_side_stream: torch.cuda.Stream | None = None


def side_stream() -> torch.cuda.Stream:
    """One side stream for warm-ups and captures, as torchtitan's manager keeps one."""
    global _side_stream
    if _side_stream is None:
        _side_stream = torch.cuda.Stream()
    return _side_stream


class GraphedStep:
    """``fn`` (a forward and backward) as torchtitan's trainer runs it with CUDA graphs.

    Call 1 runs eager (on a side stream on CUDA), call 2 captures and replays, later
    calls copy the input into the captured one and replay. Each graph gets a memory pool
    of its own: two graphs of one model are replayed in any order here, and a pool shared
    with another graph could hand that graph's temporaries memory this one keeps across
    replays. ``backend``: see :func:`graph_backend`.
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor,
                 backend: str) -> None:  # fmt: skip
        self.fn = fn
        self.backend = backend
        self.calls = 0
        self.graph: Any = None
        self.ids: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.wrapper: Any = None
        if backend == "torchtitan":
            from torchtitan.distributed import cudagraph

            self.wrapper = cudagraph.CUDAGraphWrapper(fn, [ids])

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.wrapper is not None:
            if self.calls == 2:  # the call that captures
                from torchtitan.distributed import cudagraph

                cudagraph._manager._graph_pool = torch.cuda.graph_pool_handle()
            return self.wrapper(ids)
        if self.calls == 1:
            return self._warm_up(ids)
        if self.graph is None:
            self._capture(ids)
            if self.backend == "stand-in":
                assert self.output is not None
                return self.output  # the stand-in ran the step as it recorded it
        else:
            assert self.ids is not None
            self.ids.copy_(ids)
        self.graph.replay()
        assert self.output is not None
        return self.output

    def _warm_up(self, ids: torch.Tensor) -> torch.Tensor:
        if self.backend != "cuda":
            return self.fn(ids)
        stream = side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = self.fn(ids)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def _capture(self, ids: torch.Tensor) -> None:
        self.ids = ids
        if self.backend == "stand-in":
            self.graph = StandInGraph()
            with self.graph.capture():
                self.output = self.fn(ids)
            return
        self.graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(self.graph, pool=pool, stream=side_stream(),
                              capture_error_mode="thread_local"):  # fmt: skip
            self.output = self.fn(ids)

    def close(self) -> None:
        """Drop the graph and its memory pool (freed at the next ``empty_cache``)."""
        if self.wrapper is not None:
            from torchtitan.distributed import cudagraph

            self.wrapper.teardown()
            if self.wrapper in cudagraph._manager._wrappers:
                cudagraph._manager._wrappers.remove(self.wrapper)
            self.wrapper = None
        self.graph = self.ids = self.output = None


@dataclass
class TrainLoop:
    """One workload's training loop, eager or through one of its graphs, with the
    monitor handle attached for that graph's steps."""

    work: Workload
    backend: str
    graphs: dict[str, GraphedStep] = field(default_factory=dict)
    handles: dict[str, MonitorHandle] = field(default_factory=dict)
    steps_done: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    """Steps run, by mode."""
    names: dict[str, set[str]] = field(default_factory=dict)
    """Metric names each mode's handle returned values of, its own costs left out
    (none: its monitors measured nothing in the graph)."""
    activation_bytes: int = 0
    """A step's peak memory over what lives between steps (CUDA; 0 on a CPU)."""

    def forward_backward(self, ids: torch.Tensor) -> torch.Tensor:
        """What a graph captures (``ids`` is the workload's own batch: the models read
        it there)."""
        work = self.work
        with torch.autocast(work.device.type, dtype=torch.bfloat16, enabled=work.bf16):
            loss = step_loss(work)
        loss.backward()
        return loss.detach()

    def add_graph(self, mode: str, handle: MonitorHandle | None = None) -> None:
        self.graphs[mode] = GraphedStep(self.forward_backward, self.work.ids, self.backend)
        if handle is not None:
            self.handles[mode] = handle

    def drop(self, mode: str) -> None:
        graph = self.graphs.pop(mode, None)
        if graph is not None:
            graph.close()
        self.handles.pop(mode, None)

    def train_step(self, mode: str) -> float:
        """One training step of ``mode`` (``eager`` or a graph's); wall seconds up to
        the loss read, the step's one sync."""
        work = self.work
        start = time.perf_counter()
        # In place in every mode: a graph's backward accumulates into the gradients'
        # captured addresses, which an eager step must not free.
        work.optimizer.zero_grad(set_to_none=False)
        run = self.forward_backward if mode == "eager" else self.graphs[mode]
        loss = run(work.ids)
        norm = torch.nn.utils.clip_grad_norm_(work.params, 1.0)
        work.optimizer.step()
        handle = self.handles.get(mode)
        records = None
        if handle is not None:
            records = handle.step(self.steps_done, loss=loss, grad_norm=norm)
        self.steps_done += 1
        self.counts[mode] = self.counts.get(mode, 0) + 1
        loss.item()
        elapsed = time.perf_counter() - start
        if records is not None:  # after the clock stopped
            self.saw(mode, records)
        return elapsed

    def saw(self, mode: str, records: StepRecords) -> None:
        seen = self.names.setdefault(mode, set())
        for chunk in records.chunks():
            seen.update(n for n in chunk[3] if not n.startswith("monitors/self/"))

    def segment(self, mode: str, warmup: int, steps: int) -> list[float]:
        """Timed steps of one segment; a mode's handle measures during it only."""
        handle = self.handles.get(mode)
        if handle is not None:
            handle.resume()
        try:
            times = [self.train_step(mode) for _ in range(warmup + steps)]
        finally:
            if handle is not None:
                handle.pause()
        return times[warmup:]

    def close(self) -> None:
        for mode in list(self.graphs):
            self.drop(mode)


def peak_activations(loop: TrainLoop) -> int:
    """Bytes one eager step allocates above what lives between steps (CUDA only)."""
    if loop.work.device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loop.train_step("eager")
    return torch.cuda.max_memory_allocated() - base


def check_room(loop: TrainLoop, what: str) -> None:
    """Refuse a new graph that would not fit: its eager warm-up and then its own pool
    need about one step's activations (a failed capture can leave CUDA unusable)."""
    if loop.work.device.type != "cuda":
        return
    free_memory()
    free = torch.cuda.mem_get_info()[0]
    need = 1.1 * loop.activation_bytes
    print(f"  {what}: {free / 2**30:.1f} GiB free, a step's activations "
          f"{loop.activation_bytes / 2**30:.1f} GiB")  # fmt: skip
    if free < need:
        raise MemoryError(f"{what}: {free / 2**30:.1f} GiB free < {need / 2**30:.1f} GiB needed")


def steps_for(step_s: float, seconds: float, minimum: int) -> int:
    """Steps of a segment of about ``seconds``, at least ``minimum``."""
    return max(minimum, min(1000, round(seconds / max(step_s, 1e-6))))


def segment_rounds(loop: TrainLoop, modes: list[str], lengths: dict[str, tuple[int, int]],
                   rounds: int, deadline: float) -> Rounds:  # fmt: skip
    """Rounds of one segment per mode, in an order rotated by the round; stops before a
    round that would end past ``deadline`` (one round always runs)."""

    def progress(r: int, times: dict[str, list[float]], seconds: float) -> None:
        means = ", ".join(f"{m} {statistics.fmean(times[m]) * 1e3:.2f} ms" for m in modes)
        print(f"  round {r}: {seconds:.1f} s; {means}", flush=True)

    contestants = {mode: partial(loop.segment, mode, *lengths[mode]) for mode in modes}
    gc.collect()
    gc.freeze()  # the model's objects leave the collector's generations
    try:
        return interleave(contestants, rounds, deadline=deadline, after_round=progress)
    finally:
        gc.unfreeze()


def phase_graphs(loop: TrainLoop, args: argparse.Namespace, deadline: float,
                 step_s: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    """Eager against the graph captured without syncless."""
    n = steps_for(step_s["eager"], args.seg_seconds, args.min_seg)
    lengths = {"eager": (args.warmup, n), "off": (args.warmup, n)}
    print(f"  graphs: eager vs off, {n} timed steps per segment", flush=True)
    rounds = segment_rounds(loop, ["eager", "off"], lengths, args.rounds, deadline)
    return {"rounds": rounds, "speedups": round_ratios(rounds, "eager", "off"), "steps": n}


def phase_monitored(mode: str, loop: TrainLoop, args: argparse.Namespace, deadline: float,
                    step_s: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    """The stack (or the alarm alone) in a graph of its own against the off graph."""
    work = loop.work
    check_room(loop, mode)
    names = "all" if mode == "stack" else ["nonfinite"]
    monitors = build(names, optimizer=work.optimizer)
    handle = attach(work.model, monitors, run=None, budget=args.budget, strict=args.smoke)
    loop.add_graph(mode, handle)
    try:
        # The warm-up call, the capture, then steps for the budget to learn its cadences.
        settle = [loop.train_step(mode) for _ in range(max(2, args.settle))]
        handle.pause()
        print(f"  {mode}: captured and settled over {len(settle)} steps "
              f"(last {settle[-1] * 1e3:.2f} ms), cadences {handle.cadences}"
              + memory_text(work.device), flush=True)  # fmt: skip
        n = steps_for(step_s["off"], args.stack_seg_seconds, args.stack_min_seg)
        lengths = {"off": (args.warmup, n), mode: (args.stack_warmup, n)}
        rounds = segment_rounds(loop, ["off", mode], lengths, args.rounds, deadline)
        out = {
            "rounds": rounds,
            "overheads": round_overheads(rounds, mode, "off"),
            "steps": n,
            "settle_s": settle,
            "cadences": dict(handle.cadences),
            "idle": dict(handle.idle),
        }
    finally:
        loop.saw(mode, handle.close())  # the graph's kernels then return early
        errors = dict(handle.failures.counts)
        loop.drop(mode)
    names = sorted(loop.names.get(mode, ()))
    out.update(errors=errors, metric_names=names, steps_run=loop.counts.get(mode, 0))
    return out


def memory_text(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    return f"; {alloc / 2**30:.1f} GiB allocated, {reserved / 2**30:.1f} GiB reserved"


def run_case(case: Case, args: argparse.Namespace, device: torch.device, deadline: float,
             backend: str, matmul: float | None) -> dict[str, Any]:  # fmt: skip
    """Build, capture, measure every phase of one case; returns its JSON entry."""
    work = case.build(case.spec, device)
    loop = TrainLoop(work, backend)
    print(f"{case.key}: built in {work.build_s:.1f} s, {params_text(work.n_params)} params, "
          f"experts {work.experts}", flush=True)  # fmt: skip
    entry: dict[str, Any] = {"spec": dataclasses.asdict(case.spec), "params": work.n_params,
                             "flops_per_step": work.flops, "backend": backend,
                             "attention": attention_of(work), "phases": {}, "failed": {},
                             "skipped": {}}  # fmt: skip
    try:
        for _ in range(2):  # allocate (AdamW's state too), pick kernels: nothing attached
            loop.train_step("eager")
        loop.activation_bytes = peak_activations(loop)
        eager = [loop.train_step("eager") for _ in range(3)]
        check_room(loop, "off graph")
        loop.add_graph("off")
        for _ in range(3):  # the warm-up call, the capture, a replay
            loop.train_step("off")
        off = [loop.train_step("off") for _ in range(3)]
        step_s = {"eager": statistics.median(eager), "off": statistics.median(off)}
        entry.update(initial_eager_s=eager, initial_off_s=off)
        print(f"  before the rounds: {throughput(work, step_s['eager'], None, 'eager')}; "
              f"{throughput(work, step_s['off'], None, 'graph')}" + memory_text(device),
              flush=True)  # fmt: skip
        phases = [p for p in PHASES if p in args.phases]
        for i, phase in enumerate(phases):
            now = time.perf_counter()
            if now > args.end_by:  # every case's time is spent: the next case is skipped too
                entry["skipped"][phase] = "time was up"
                continue
            share = PHASE_WEIGHTS[phase] / sum(PHASE_WEIGHTS[p] for p in phases[i:])
            phase_deadline = now + max(0.0, deadline - now) * share
            try:
                if phase == "graphs":
                    result = phase_graphs(loop, args, phase_deadline, step_s)
                else:
                    result = phase_monitored(phase, loop, args, phase_deadline, step_s)
                entry["phases"][phase] = result
            except Exception as e:  # the next phase still runs (an OOM, a failed capture)
                traceback.print_exc()
                entry["failed"][phase] = f"{type(e).__name__}: {first_line(e)}"
            free_memory()
        entry["line"] = summarize(case, entry, work, matmul, args)
    finally:
        loop.close()
    return entry


def first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0][:160]


def summarize(case: Case, entry: dict[str, Any], work: Workload, matmul: float | None,
              args: argparse.Namespace) -> str:  # fmt: skip
    """Print the case's figures; return its RESULTS.md line."""
    spec, phases, failed = case.spec, entry["phases"], entry["failed"]
    parts = [
        monitored_text(entry, "stack", STACK_TARGET),
        monitored_text(entry, "alarm", ALARM_TARGET),
    ]
    if "graphs" in phases:
        parts.append(graphs_text(entry, work, matmul))
    else:
        parts.append(
            f"graphs {'failed (' + failed['graphs'] + ')' if 'graphs' in failed else 'not measured'}"
        )
    head = (
        f"{spec.name} ({spec.layers} layers, B {spec.batch} x L {spec.seq_len}, "
        f"{params_text(entry['params'])} params"
        + (f", {spec.experts} experts top-{spec.top_k}" if spec.experts else "")
        + ")"
    )
    backend = {
        "torchtitan": "torchtitan's CUDAGraphWrapper",
        "cuda": "torch.cuda.graph in CUDAGraphWrapper's pattern (torchtitan did not import)",
        "stand-in": "syncless.graphs.StandInGraph on a CPU",
    }[entry["backend"]]
    lengths = ", ".join(f"{m} {p['steps']}" for m, p in phases.items())
    precision = "bf16 autocast over fp32" if work.bf16 else "fp32"
    method = (
        f"{case.stack} model, attention {entry['attention']}, {precision}; "
        f"{backend}, one memory pool per graph; AdamW and clip 1.0 outside the graph, "
        "zero_grad(set_to_none=False) in every mode, one loss read per step; median "
        "[min..max] (rounds) of per-round mean step ratios; timed steps per segment "
        f"({lengths}) after {args.warmup} untimed (monitored {args.stack_warmup}); each "
        f"handle ran {args.settle} steps after its capture before the rounds and was paused "
        "while the off graph ran"
    )
    notes = []
    for mode in ("stack", "alarm"):
        if mode in phases:
            p = phases[mode]
            every = ", ".join(f"{k} {v}" for k, v in p["cadences"].items())
            errors = sum(p["errors"].values())
            idle = f"; idle: {', '.join(p['idle'])}" if p["idle"] else ""
            notes.append(
                f"{mode}: cadences at the end every {every}{idle}; values of "
                f"{len(p['metric_names'])} metrics over its {p['steps_run']} steps; "
                f"syncless errors {errors}" + (f" {p['errors']}" if errors else "")
            )
    line = f"{head}: CUDA graph: " + "; ".join(parts) + f"; {method}"
    line += "".join(f"; {n}" for n in notes)
    print(f"  {line}", flush=True)
    return line


def monitored_text(entry: dict[str, Any], mode: str, target: float) -> str:
    if mode in entry["phases"]:
        est = entry["phases"][mode]["overheads"]
        return f"{mode} {spread(est)} ({verdict(est, target)})"
    if mode in entry["failed"]:
        return f"{mode} failed ({entry['failed'][mode]})"
    return f"{mode} not measured ({entry['skipped'].get(mode, 'not asked')})"


def graphs_text(entry: dict[str, Any], work: Workload, matmul: float | None) -> str:
    """The graphed speed-up, with both step times, tokens/s and MFU."""
    rounds = entry["phases"]["graphs"]["rounds"]
    eager_s = statistics.median(entry["initial_eager_s"] + _steps(rounds, "eager"))
    off_s = statistics.median(entry["initial_off_s"] + _steps(rounds, "off"))
    tokens = work.spec.batch * work.spec.seq_len
    text = (
        f"graphs buy {spread(entry['phases']['graphs']['speedups'], 1.0, 'x', '')} (eager "
        f"{eager_s * 1e3:.1f} -> graphed {off_s * 1e3:.1f} ms/step, "
        f"{tokens / eager_s / 1e3:.1f}k -> {tokens / off_s / 1e3:.1f}k tokens/s"
    )
    if work.device.type == "cuda":
        mfu = [work.flops / s / H200_BF16_PEAK * 100 for s in (eager_s, off_s)]
        text += f", MFU {mfu[0]:.1f}% -> {mfu[1]:.1f}% of 989 TFLOP/s"
        if matmul:
            text += (
                f" (graphed: {work.flops / off_s / matmul * 100:.1f}% of the measured matmul rate)"
            )
    return text + ")"


def _steps(rounds: Rounds, mode: str) -> list[float]:
    return [t for times in rounds for t in times.get(mode, [])]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    keys = list(cases(smoke=False))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", help=f"comma list of {keys} (default: all)")
    parser.add_argument(
        "--phases", default=",".join(PHASES), help="comma list of " + ", ".join(PHASES)
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seg-seconds", type=float, default=1.0,
                        help="eager/graph segments: about this long")  # fmt: skip
    parser.add_argument("--stack-seg-seconds", type=float, default=1.5,
                        help="off/stack and off/alarm segments: about this long")  # fmt: skip
    parser.add_argument("--min-seg", type=int, default=4, help="timed steps per segment, at least")
    parser.add_argument(
        "--stack-min-seg", type=int, default=16,
        help="timed steps per off/monitored segment, at least: the budget's cadences run up "
        "to every ~16 steps",
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per segment")
    parser.add_argument("--stack-warmup", type=int, default=4,
                        help="untimed steps per monitored segment (after its resume)")  # fmt: skip
    parser.add_argument(
        "--settle", type=int, default=40,
        help="steps of a monitored graph before its rounds (its warm-up call and capture "
        "included): the budget learns its cadences over tens of steps",
    )  # fmt: skip
    parser.add_argument("--budget", type=float, default=0.01, help="the monitors' budget")
    parser.add_argument("--max-seconds", type=float, default=390.0,
                        help="every case together (a share each; at most ~7 min on an H100)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny shapes, StandInGraph, few steps, no append")  # fmt: skip
    parser.add_argument("--json", help="write raw step times and estimates here")
    parser.add_argument("--no-append", action="store_true", help="skip bench/RESULTS.md")
    args = parser.parse_args(argv)
    args.cases = args.cases.split(",") if args.cases else list(cases(args.smoke))
    args.phases = args.phases.split(",")
    if set(args.phases) - set(PHASES):
        parser.error(f"--phases: a comma list of {list(PHASES)}")
    if args.smoke:
        args.rounds, args.min_seg, args.stack_min_seg = 2, 2, 3
        args.seg_seconds = args.stack_seg_seconds = 0.0
        args.warmup, args.stack_warmup, args.settle = 1, 1, 4
        args.no_append = True
    return args


def main(argv: list[str] | None = None) -> None:
    start = time.perf_counter()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # progress, live
    args = parse_args(argv)
    args.end_by = start + args.max_seconds
    if args.smoke:  # tiny steps gain nothing from threads, and on a busy CPU a parallel
        torch.set_num_threads(1)  # region waiting for a descheduled thread took seconds
    device, matmul = bench_device(args.smoke)
    backend = graph_backend(device)
    table = cases(args.smoke)
    unknown = [k for k in args.cases if k not in table]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(table)}")
    chosen = [table[k] for k in args.cases]
    print(f"{device.type}, graphs: {backend}, budget {args.budget:g}, {args.rounds} rounds, "
          f"phases {args.phases}, {len(chosen)} cases in {args.max_seconds:g} s", flush=True)  # fmt: skip
    results: dict[str, Any] = {}
    lines: dict[str, str] = {}
    for i, case in enumerate(chosen):
        now = time.perf_counter()
        left = args.max_seconds - (now - start)
        if left < 15 and not args.smoke:
            print(f"\n{case.key}: skipped, {now - start:.0f} s elapsed")
            continue
        deadline = now + left * case.weight / sum(c.weight for c in chosen[i:])
        print(f"\n{case.key}: {deadline - now:.0f} s of the {left:.0f} s left", flush=True)
        try:
            results[case.key] = entry = run_case(case, args, device, deadline, backend, matmul)
            lines[case.key] = entry["line"]
            if not args.no_append:  # case by case: a run cut short keeps what it measured
                append_result("cuda_graphs", entry["line"])
        except Exception:  # the next case still runs
            traceback.print_exc()
        finally:
            if backend == "torchtitan":
                from torchtitan.distributed import cudagraph

                cudagraph.cudagraph_teardown()
            free_memory()
        if args.json:
            write_json(args.json, matmul, args, results)
        print(f"  {case.key}: done at {time.perf_counter() - start:.0f} s", flush=True)
    print(f"\n{len(lines)} of {len(chosen)} cases measured in {time.perf_counter() - start:.0f} s")
