"""Step-time overhead of syncless on GPU-bound training steps of real model shapes.

The demo's train step (bench/demo/train_step.py) is host-bound: the device idles between
its kernels, so device work a monitor adds can hide there. Real shapes keep the device
busy, which makes these numbers the primary evidence for overhead claims. Each model
is a Hugging Face model built from its config (random weights, sdpa attention, bf16
autocast over float32 parameters, fused AdamW, grad clipping, one loss read per step).

Measured per model, in one process: the monitor stack with its overhead budget, each
monitor alone at every step, the nonfinite alarm alone as the stack runs it (``alarm``:
checked every step, read at the budget's cadence), the section profiler, and a
naive-hook baseline
(bench/monitors/naive.py), against ``off``. Modes run in segments, interleaved A/B: in
each round every mode runs one segment, in an order rotated by the round. A mode's
overhead in a round is its mean step time over the ``off`` segment's of that round;
the table gives the median over rounds and their spread. Shapes and the training
step: bench/stacks/hf_models.py; the segments: bench/stacks/segments.py.

    python -m bench.stacks real_models                     # all models, on one H200
    python -m bench.stacks real_models --tiny --no-append  # a CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import transformers

from bench.harness import append_result, round_overheads, spread
from bench.monitors.naive import NaiveMonitors
from bench.stacks.hf_models import (
    ModelSpec,
    Workload,
    bench_device,
    build_workload,
    count_syncs,
    free_memory,
    model_specs,
    params_text,
    throughput,
    tiny,
    train_step,
    write_json,
)
from bench.stacks.segments import (
    ModelState,
    Segment,
    attach_kwargs,
    measure,
    monitor_step,
    open_kept,
    open_stack,
    run_segment,
    stack_label,
    stack_note,
    verdict,
)
from syncless.monitors import MONITORS, attach, build
from syncless.monitors.adapters import find_layers
from syncless.profile import Profiler


@dataclass
class ProfiledState(ModelState):
    """A model's state, with the profiler's, kept across its segments."""

    profiler: Any = None
    layer_row: str = ""


def open_profile(state: ProfiledState) -> Segment:
    if state.profiler is None:  # one profiler per model: its reports span segments
        state.profiler = Profiler(mode="events", report_every=10)
    prof = state.profiler
    hooks = [h for layer in state.work.layers for h in prof.hook_module(layer, "layer")]

    def report(step: int) -> None:
        rep = prof.report(step)
        if rep is not None:
            row = rep.row("layer")
            state.layer_row = f"{row.ms_per_step:.1f} ms/step ({row.pct_of_step:.0f}%)"

    def close() -> None:
        for h in hooks:
            h.remove()

    return Segment(context=prof.step, prof=prof, after_read=report, close=close)


def open_segment(mode: str, state: ProfiledState) -> Segment:
    work = state.work
    if mode == "off":
        return Segment()
    if mode == "stack":
        return open_stack(state)
    if mode == "profile":
        return open_profile(state)
    if mode == "naive":
        naive = NaiveMonitors(find_layers(work.model))
        return Segment(flush=lambda step: naive.norms(work.model), close=naive.close)
    if mode == "alarm":
        # The nonfinite alarm as the default stack runs it: its check at every step,
        # its readout at the budget's cadence (issue #35's cost target: <= 0.3%); one
        # handle paused between segments, like the stack's.
        return open_kept(state, mode, ["nonfinite"])
    monitors = build([mode], optimizer=work.optimizer, every=1)  # flushed every step
    handle = attach(work.model, monitors, **attach_kwargs(None))
    return Segment(flush=partial(monitor_step, handle, work), close=handle.close)


def segment_lengths(args: argparse.Namespace, mode: str) -> tuple[int, int]:
    """Untimed and timed steps of a segment of ``mode``."""
    if mode in ("stack", "alarm"):  # budgeted: a settled budget's steps
        return args.stack_warmup, args.stack_seg
    return args.warmup, args.seg


def modes_for(spec: ModelSpec, wanted: list[str]) -> list[str]:
    monitors = [m for m in MONITORS if m != "moe" or spec.experts]
    applicable = ["off", "stack", *monitors, "alarm", "profile", "naive"]
    return [m for m in applicable if m in wanted]


def summarize(
    state: ProfiledState, modes: list[str], off_steps: list[float], rounds, failed, matmul
):
    """Print the model's table; return its summary (also the RESULTS.md line)."""
    work, spec = state.work, state.work.spec
    off_s = statistics.median(off_steps)
    workload = (
        f"{spec.name} ({spec.layers} layers, B {spec.batch} x L {spec.seq_len}, "
        f"{params_text(work.n_params)} params, experts {work.experts}): "
        + throughput(work, off_s, matmul)
    )
    print(workload)
    rows = {}
    print(f"  {'mode':<40}{'median':>9}{'min..max':>20}{'rounds':>8}")
    for mode in (m for m in modes if m != "off"):
        est = round_overheads(rounds, mode)
        if not est:
            continue
        label = stack_label(state.budget) if mode == "stack" else mode
        med, lo, hi = statistics.median(est), min(est), max(est)
        rows[label] = spread(est)
        if mode == "stack":
            rows[label] += f" ({verdict(est, state.budget)})"
        print(f"  {label:<40}{med * 100:>+8.2f}%{lo * 100:>+10.2f}..{hi * 100:+.2f}%{len(est):>8}")
    for mode, error in failed.items():
        label = stack_label(state.budget) if mode == "stack" else mode
        rows[label] = " ".join(filter(None, [rows.get(label), f"failed ({error})"]))
        print(f"  {label:<40}failed: {error}")
    notes = []
    if "stack" in modes:
        notes.append(stack_note(state))
    if state.cadences:
        every = ", ".join(f"{k} {v}" for k, v in state.cadences.items())
        notes.append(f"stack cadences at the end: every {every}")
    if state.self_records:
        own = ", ".join(f"{k.removeprefix('monitors/self/')} {statistics.fmean(v):.2f}"
                        for k, v in state.self_records.items())  # fmt: skip
        notes.append(f"stack self-billed (mean per flushed step) {own}")
    if state.layer_row:
        notes.append(f"profiler's layer row {state.layer_row}")
    for note in notes:
        print("  " + note)
    return {"workload": workload, "rows": rows, "notes": notes, "off_ms": off_s * 1e3}


def run_model(
    spec: ModelSpec,
    args: argparse.Namespace,
    device,
    deadline: float,
    matmul,
    build: Callable[[ModelSpec, Any], Workload] = build_workload,
):
    """Build, warm up, measure and report one model; returns its JSON entry."""
    work = build(spec, device)
    print(f"\n{spec.name}: built in {work.build_s:.1f} s, experts {work.experts}")
    for _ in range(3):  # allocate, pick kernels: nothing attached
        train_step(work)
    state = ProfiledState(work=work, budget=args.budget)
    initial = run_segment("off", state, warmup=0, steps=3, open_segment=open_segment)
    if device.type == "cuda":
        print(f"  syncs in an off step: {count_syncs(work)} (1 expected: the loss read)")
    print(f"  before the rounds: {throughput(work, statistics.median(initial), matmul)}")
    modes = modes_for(spec, args.modes)
    gc.collect()
    gc.freeze()  # the model's objects leave the collector's generations
    try:
        rounds, failed = measure(
            state, modes, open_segment, partial(segment_lengths, args), args.rounds, deadline
        )
    finally:
        gc.unfreeze()
    off_steps = initial + [t for times in rounds for t in times.get("off", [])]
    summary = summarize(state, modes, off_steps, rounds, failed, matmul)
    return {
        "spec": dataclasses.asdict(spec),
        "params": work.n_params,
        "matmul_params": work.n_matmul,
        "flops_per_step": work.flops,
        "initial_off_s": initial,
        "rounds": rounds,
        "overheads": {m: round_overheads(rounds, m) for m in modes if m != "off"},
        "self_records": state.self_records,
        **summary,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = list(model_specs())
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_models = [n for n in names if n != "demo-large"]  # the demo: on request
    parser.add_argument("--models", default=",".join(default_models), help=f"comma list of {names}")
    default_modes = ["off", "stack", *MONITORS, "alarm", "profile", "naive"]
    parser.add_argument("--modes", default=",".join(default_modes), help="comma list")
    parser.add_argument("--layers8b", type=int, default=6, help="layers of llama3-8b-layers")
    parser.add_argument("--rounds", type=int, help="default 4 (--tiny: 2)")
    parser.add_argument("--seg", type=int, help="timed steps per segment; default 6 (--tiny: 3)")
    parser.add_argument(
        "--stack-seg", type=int,
        help="timed steps per stack segment, default 20 (--tiny: 6): its cadences go up to "
        "every 10 steps and a budget controller adapts them",
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per segment")
    parser.add_argument(
        "--stack-warmup", type=int, default=10,
        help="untimed steps per stack segment: the budget measures each monitor on its "
        "first active steps and sets the cadences; a month-long run lives in that state",
    )  # fmt: skip
    parser.add_argument("--budget", type=float, default=0.01, help="the stack's budget")
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU")
    parser.add_argument("--max-seconds", type=float, default=540.0)
    parser.add_argument("--json", help="write raw step times and estimates here")
    parser.add_argument("--no-append", action="store_true", help="skip bench/RESULTS.md")
    args = parser.parse_args(argv)
    defaults = {"rounds": 2, "seg": 3, "stack_seg": 6} if args.tiny else {
        "rounds": 4, "seg": 6, "stack_seg": 20
    }  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.models = args.models.split(",")
    args.modes = args.modes.split(",")
    if "off" not in args.modes or set(args.modes) - set(default_modes):
        parser.error(f"--modes: a comma list of {default_modes}, with off (the reference)")
    return args


def main(argv: list[str] | None = None) -> None:
    start = time.perf_counter()
    args = parse_args(argv)
    specs = model_specs(args.layers8b)
    unknown = [m for m in args.models if m not in specs]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {list(specs)}")
    device, matmul = bench_device(args.tiny)
    use_cuda = device.type == "cuda"
    print(f"{device.type}, {stack_label(args.budget)}, seg {args.seg} / stack {args.stack_seg}"
          f" timed + {args.warmup} warm-up steps, {args.rounds} rounds")  # fmt: skip
    results: dict[str, Any] = {}
    cheapest_round_s = 0.0  # a model's build and first round cost at least this
    for i, name in enumerate(args.models):
        elapsed = time.perf_counter() - start
        if elapsed + cheapest_round_s > args.max_seconds:
            print(f"\n{name}: skipped, {elapsed:.0f} s elapsed")
            continue
        # An equal share of the time left, so one slow model cannot starve the rest.
        deadline = start + elapsed + (args.max_seconds - elapsed) / (len(args.models) - i)
        spec = tiny(specs[name]) if args.tiny else specs[name]
        try:
            results[name] = entry = run_model(spec, args, device, deadline, matmul)
            per_round = (time.perf_counter() - start - elapsed) / max(1, len(entry["rounds"]))
            cheapest_round_s = min(cheapest_round_s or per_round, per_round)
        except Exception:  # the next model still runs
            traceback.print_exc()
        free_memory()
    if args.json:
        write_json(args.json, matmul, args, results)
    if args.no_append:
        return
    precision = "bf16 autocast over fp32" if use_cuda else "fp32"
    for entry in results.values():
        rows = "; ".join(f"{k} {v}" for k, v in entry["rows"].items())
        append_result(
            "real_models",
            f"{entry['workload']}; transformers {transformers.__version__}, {precision}, "
            f"sdpa, AdamW, clip 1.0; overhead per mode, "
            f"median [min..max] (rounds) of per-round mean step over the off segment's, "
            f"segments {args.seg} steps (stack {args.stack_seg}) after {args.warmup} untimed "
            f"(stack {args.stack_warmup}): {rows}" + "".join(f"; {n}" for n in entry["notes"]),
        )
