"""torch.compile and the monitor stack: does the compiled step keep its speed-up within
the stack's budget? (issue #20)

Per model, in one process, three modes in interleaved segments (bench/stacks/segments.py):
``eager-off`` (the plain step), ``compiled-off`` (the same model compiled) and
``compiled-stack`` (compiled, with every monitor attached at budget 0.01, as in
bench/stacks/real_models.py). The speed-up is eager over compiled per round; the stack's
overhead is compiled-stack over compiled-off. Dynamo's counters are read around every
step: compiles and graph breaks in timed steps are reported, and should be 0.

    python -m bench.stacks compiled_models                     # 3 models, on one H200
    python -m bench.stacks compiled_models --tiny --no-append  # a CPU smoke test (aot_eager)

The default compiles each decoder layer (``layer.compile()``), as torchtitan does:
the layers share one graph (two with the stack's hooks), so compile time does not grow
with depth, and the loss,
the optimizer and the monitors' flush stay eager. ``--compile-scope model`` compiles
the whole model in place (``model.compile()``, which is ``torch.compile(model)``
without the wrapper). ``eager-off`` runs the same modules under
``torch.compiler.set_stance("force_eager")``.

Compiling is lazy: it traces at the first call, with the hooks registered then, so
attaching before or after ``compile()`` gives the same graphs (examples/fsdp2_loop.py
compiles, then attaches). Hooks added after the first compiled call are another
matter: by default dynamo does not guard on module hooks, so the cached graphs run
without them (a 2-layer tiny Mixtral, aot_eager, CPU: 14 of 56 layer metrics compiled
per layer, none compiled whole; the cache is shared by every model of the same
architecture). The
segments attach to a model that has run, so this bench sets
``torch._dynamo.config.skip_nnmodule_hook_guards = False``: the stack's hooks then
compile once per set of active monitors, a re-attached stack reuses those graphs, and
a stack segment under ``force_eager`` (before the rounds) checks that the compiled
stack records the same layer metrics.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import transformers
from torch._dynamo.utils import counters

from bench.harness import Rounds, append_result, round_ratios, spread
from bench.stacks.dynamo_counts import LIMIT_HITS, ZERO, DynamoCounts
from bench.stacks.hf_models import (
    ModelSpec,
    bench_device,
    build_workload,
    free_memory,
    model_specs,
    params_text,
    throughput,
    tiny,
    write_json,
)
from bench.stacks.segments import (
    ModelState,
    Segment,
    measure,
    open_stack,
    run_segment,
    stack_label,
    stack_note,
    verdict,
)

MODES = ("eager-off", "compiled-off", "compiled-stack")
LAYER = "monitors/layer_"  # the per-layer metrics, recorded by hooks in the compiled graphs
DEFAULT_MODELS = ("llama3-8b-layers", "qwen3-1.7b", "mixtral")


@dataclass
class CompiledState(ModelState):
    """A model's state across its segments, with what dynamo did in each mode."""

    phase: str = "before the rounds"
    """Where the counts go: ``before the rounds``, or a segment's ``warm-up`` / ``timed``."""
    counts: dict[tuple[str, str], DynamoCounts] = field(default_factory=dict)
    """(mode, phase) -> dynamo's counts over those steps."""
    recompiled: dict[str, list[list[int]]] = field(default_factory=dict)
    """Per mode, per segment: the timed steps that compiled (index in the segment)."""
    layer_names: dict[str, set[str]] = field(default_factory=dict)
    """Per stack mode: the layer metrics it recorded before the rounds."""
    break_reasons: dict[str, int] = field(default_factory=dict)
    """Dynamo's graph breaks while this model ran: reason -> count."""


@contextmanager
def counted_step(state: CompiledState, mode: str, first_timed: int, step: int) -> Iterator[None]:
    """One step of ``mode``, eager under ``force_eager``; adds dynamo's counts to its phase."""
    phase = state.phase
    if phase != "before the rounds":
        phase = "timed" if step >= first_timed else "warm-up"
    eager = mode.startswith("eager")
    stance = torch.compiler.set_stance("force_eager") if eager else nullcontext()
    before = DynamoCounts.now()
    start = time.perf_counter()
    with stance:
        yield
    delta = DynamoCounts.now() - before
    if delta.frames:
        delta = delta._replace(compile_s=time.perf_counter() - start)
    state.counts[mode, phase] = state.counts.get((mode, phase), ZERO) + delta
    if phase == "timed" and delta.frames:
        state.recompiled[mode][-1].append(step - first_timed)
    if phase == "before the rounds" and mode.endswith("stack"):  # untimed: a check
        names = state.layer_names.setdefault(mode, set())
        names.update(r.name for r in state.handle.last_records if r.name.startswith(LAYER))


def open_mode(args: argparse.Namespace, mode: str, state: CompiledState) -> Segment:
    segment = open_stack(state) if mode.endswith("stack") else Segment()
    first_timed = state.step + segment_lengths(args, mode)[0]
    segment.context = partial(counted_step, state, mode, first_timed)
    state.recompiled.setdefault(mode, []).append([])
    return segment


def segment_lengths(args: argparse.Namespace, mode: str) -> tuple[int, int]:
    """Untimed and timed steps of a segment of ``mode``."""
    if mode.endswith("stack"):
        return args.stack_warmup, args.stack_seg
    return args.warmup, args.seg


def compile_model(work: Any, scope: str, backend: str) -> None:
    """``compile()`` each decoder layer, or the whole model, in place (lazy)."""
    for module in work.layers if scope == "layer" else [work.model]:
        module.compile(backend=backend)


def prelude(state: CompiledState, args: argparse.Namespace) -> dict[str, float]:
    """Untimed steps before the rounds: eager (with the stack, its layer metrics for the
    check), compiling, then a stack segment (the graphs of its hooks under the budget's
    first cadences). Returns a step's seconds, eager and compiled."""
    run = partial(run_segment, open_segment=partial(open_mode, args))
    eager = run("eager-off", state, 0, 3)
    run("eager-stack", state, args.stack_warmup, 0)
    compiled = run("compiled-off", state, 1, 3)  # the first compiles forward and backward
    run("compiled-stack", state, args.stack_warmup + args.stack_seg, 0)
    state.phase = "segments"
    return {"eager_s": statistics.median(eager), "compiled_s": statistics.median(compiled)}


def missing_metrics(state: CompiledState) -> list[str]:
    """Layer metrics the eager stack recorded before the rounds and the compiled did not."""
    eager = state.layer_names.get("eager-stack", set())
    return sorted(eager - state.layer_names.get("compiled-stack", set()))


def layer_check(state: CompiledState) -> str:
    names = {m: len(state.layer_names.get(m, ())) for m in ("compiled-stack", "eager-stack")}
    text = (
        f"layer metrics before the rounds: compiled stack {names['compiled-stack']}, "
        f"eager stack {names['eager-stack']}"
    )
    missing = missing_metrics(state)
    return text + (f", missing under compile: {', '.join(missing[:4])}" if missing else "")


def without_recompiles(state: CompiledState, rounds: Rounds, mode: str) -> Rounds:
    """The rounds with ``mode``'s timed steps that compiled left out."""
    out = []
    segments = state.recompiled.get(mode, [])[-len(rounds) :]  # the rounds' are the last
    for times, skipped in zip(rounds, segments, strict=False):
        kept = [t for i, t in enumerate(times.get(mode, [])) if i not in skipped]
        out.append({**times, mode: kept})
    return out


def summarize(state: CompiledState, args: argparse.Namespace, before, rounds, failed, matmul):
    """Print the model's verdict; return its summary (also the RESULTS.md line)."""
    work, spec = state.work, state.work.spec
    steps = {m: [t for times in rounds for t in times.get(m, [])] for m in MODES}
    eager_s = statistics.median(steps["eager-off"] or [before["eager_s"]])
    compiled_s = statistics.median(steps["compiled-off"] or [before["compiled_s"]])
    workload = (
        f"{spec.name} ({spec.layers} layers, B {spec.batch} x L {spec.seq_len}, "
        f"{params_text(work.n_params)} params, experts {work.experts}), compiled per "
        f"{args.compile_scope}, {args.backend}: {throughput(work, eager_s, matmul, 'eager-off')}; "
        f"{throughput(work, compiled_s, matmul, 'compiled-off')}"
    )
    print(workload)
    rows: dict[str, str] = {}
    speed_up = round_ratios(rounds, "eager-off", "compiled-off")
    if speed_up:
        rows["speed-up eager/compiled"] = spread(speed_up, 1.0, "x", "")
    with_stack = round_ratios(rounds, "eager-off", "compiled-stack")
    if with_stack:
        rows["speed-up eager/compiled-stack"] = spread(with_stack, 1.0, "x", "")
    overhead = [r - 1 for r in round_ratios(rounds, "compiled-stack", "compiled-off")]
    label = f"compiled {stack_label(state.budget)} over compiled-off"
    if overhead:
        rows[label] = f"{spread(overhead)} ({verdict(overhead, state.budget)})"
        timed = state.counts.get(("compiled-stack", "timed"), ZERO)
        if timed.frames:
            kept = without_recompiles(state, rounds, "compiled-stack")
            clean = [r - 1 for r in round_ratios(kept, "compiled-stack", "compiled-off")]
            rows[label] += f"; without the steps that compiled {spread(clean)}"
        if missing_metrics(state):
            rows[label] += "; not the whole stack: layer metrics missing under compile"
        hits = sum(c.limit_hits for (m, _), c in state.counts.items() if m == "compiled-stack")
        if hits:
            rows[label] += (
                f"; dynamo hit its recompile limit {hits}x with the stack (guard on "
                f"{LIMIT_HITS.reason}): the calls that miss the cached graphs run eagerly"
            )
    for mode, error in failed.items():
        rows[mode] = f"failed ({error})"
    for key, value in rows.items():
        print(f"  {key}: {value}")
    notes = [layer_check(state)]
    for (mode, phase), counts in sorted(state.counts.items()):
        if mode != "eager-off" and (counts != ZERO or phase == "timed"):
            notes.append(f"{mode} {phase}: {counts.text()}")
    for reason, n in state.break_reasons.items():
        lines = [line.strip().removeprefix("Explanation: ") for line in reason.splitlines()]
        notes.append(f"graph break {n}x: {' '.join(list(filter(None, lines))[:2])[:160]}")
    notes.append(stack_note(state))
    if state.cadences:
        every = ", ".join(f"{k} {v}" for k, v in state.cadences.items())
        notes.append(f"stack cadences at the end: every {every}")
    for note in notes:
        print("  " + note)
    return {"workload": workload, "rows": rows, "notes": notes}


def run_model(spec: ModelSpec, args: argparse.Namespace, device, deadline: float, matmul):
    """Build, compile, warm up, measure and report one model; returns its JSON entry."""
    work = build_workload(spec, device)
    LIMIT_HITS.reason = ""  # this model's
    print(f"\n{spec.name}: built in {work.build_s:.1f} s, experts {work.experts}")
    compile_model(work, args.compile_scope, args.backend)
    state = CompiledState(work=work, budget=args.budget)
    breaks = dict(counters["graph_break"])  # dynamo's reset keeps its counters
    before = prelude(state, args)
    took = {m: state.counts.get((m, "before the rounds"), ZERO).compile_s for m in MODES}
    print(
        f"  before the rounds: eager {before['eager_s'] * 1e3:.1f} ms/step, compiled "
        f"{before['compiled_s'] * 1e3:.1f} ms/step; steps that compiled "
        f"{took['compiled-off']:.1f} s, with the stack {took['compiled-stack']:.1f} s"
    )
    print("  per round, each mode's mean step over compiled-off's:")  # fmt: skip
    gc.collect()
    gc.freeze()  # the model's objects leave the collector's generations
    try:
        rounds, failed = measure(
            state, list(MODES), partial(open_mode, args), partial(segment_lengths, args),
            args.rounds, deadline, reference="compiled-off",
        )  # fmt: skip
    finally:
        gc.unfreeze()
    for reason, n in counters["graph_break"].items():
        if n > breaks.get(reason, 0):
            state.break_reasons[reason] = n - breaks.get(reason, 0)
    summary = summarize(state, args, before, rounds, failed, matmul)
    counts = {f"{m} {p}": c._asdict() for (m, p), c in state.counts.items()}
    return {"spec": dataclasses.asdict(spec), "before": before, "rounds": rounds,
            "counts": counts, **summary}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = list(model_specs())
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {names}")
    parser.add_argument(
        "--compile-scope", choices=("layer", "model"), default="layer",
        help="compile each decoder layer (torchtitan's way) or the whole model",
    )  # fmt: skip
    parser.add_argument("--backend", help="torch.compile backend; inductor (--tiny: aot_eager)")
    parser.add_argument("--layers8b", type=int, default=6, help="layers of llama3-8b-layers")
    parser.add_argument("--rounds", type=int, help="default 4 (--tiny: 2)")
    parser.add_argument("--seg", type=int, help="timed steps per segment; default 6 (--tiny: 3)")
    parser.add_argument(
        "--stack-seg", type=int, help="timed steps per stack segment, default 20 (--tiny: 6)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per segment")
    parser.add_argument(
        "--stack-warmup", type=int, default=10,
        help="untimed steps per stack segment: the budget settles the cadences",
    )  # fmt: skip
    parser.add_argument("--budget", type=float, default=0.01, help="the stack's budget")
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU")
    parser.add_argument("--max-seconds", type=float, default=480.0, help="the whole run's")
    parser.add_argument("--json", help="write raw step times and counts here")
    parser.add_argument("--no-append", action="store_true", help="skip bench/RESULTS.md")
    args = parser.parse_args(argv)
    defaults = {"rounds": 2, "seg": 3, "stack_seg": 6, "backend": "aot_eager"} if args.tiny else {
        "rounds": 4, "seg": 6, "stack_seg": 20, "backend": "inductor"
    }  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.models = args.models.split(",")
    unknown = [m for m in args.models if m not in names]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {names}")
    return args


def main(argv: list[str] | None = None) -> None:
    start = time.perf_counter()
    args = parse_args(argv)
    # The segments attach to models that ran compiled: their hooks must fail the guards
    # of the graphs traced without them (see the module docstring).
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    specs = model_specs(args.layers8b)
    device, matmul = bench_device(args.tiny)
    use_cuda = device.type == "cuda"
    print(f"{device.type}, torch.compile per {args.compile_scope} ({args.backend}, guards on "
          f"module hooks), {stack_label(args.budget)}, seg {args.seg} / stack {args.stack_seg} "
          f"timed + {args.warmup} / {args.stack_warmup} warm-up steps, {args.rounds} rounds")  # fmt: skip
    results: dict[str, Any] = {}
    for i, name in enumerate(args.models):
        elapsed = time.perf_counter() - start
        if elapsed > args.max_seconds:
            print(f"\n{name}: skipped, {elapsed:.0f} s elapsed")
            continue
        # An equal share of the time left, so one slow model cannot starve the rest.
        deadline = start + elapsed + (args.max_seconds - elapsed) / (len(args.models) - i)
        spec = tiny(specs[name]) if args.tiny else specs[name]
        try:
            results[name] = run_model(spec, args, device, deadline, matmul)
        except Exception:  # the next model still runs
            traceback.print_exc()
        torch._dynamo.reset()  # the model's graphs and guards go with it
        free_memory()
    print(f"\n{time.perf_counter() - start:.0f} s in all")
    if args.json:
        write_json(args.json, matmul, args, results)
    if not args.no_append:
        append(results, args, use_cuda)


def append(results: dict[str, Any], args: argparse.Namespace, use_cuda: bool) -> None:
    precision = "bf16 autocast over fp32" if use_cuda else "fp32"
    for entry in results.values():
        rows = "; ".join(f"{k} {v}" for k, v in entry["rows"].items())
        append_result(
            "compiled_models",
            f"{entry['workload']}; transformers {transformers.__version__}, {precision}, "
            "sdpa, AdamW, clip 1.0, dynamo guards on module hooks; per-round mean step "
            f"ratios, median [min..max] (rounds), segments {args.seg} steps (stack {args.stack_seg}) after {args.warmup} untimed "
            f"(stack {args.stack_warmup}): {rows}" + "".join(f"; {n}" for n in entry["notes"]),
        )
