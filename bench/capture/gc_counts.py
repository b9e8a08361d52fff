"""Python's garbage collections while one engine captures, step after step.

``bench/capture/load.py`` counts collections per segment, but builds an engine per
segment (thousands of record slots each), which can itself bring a full collection.
This keeps one engine for ``--steps`` steps of the shrunk benchmark model on the CPU
(``bench/stacks/hf_models.py``), after a ``gc.collect()``, and counts the collections of
each generation and their time per mode: what a long run pays. A full (generation 2)
collection walks every object the process tracks (bench/RESULTS.md, ``gc_pause``).

    python -m bench.capture gc_counts                              # off, mixed-deferred, mixed
    python -m bench.capture gc_counts --steps 300 --modes off,mixed
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import tempfile
from pathlib import Path

import torch

from bench.capture.gc_clock import GcClock
from bench.capture.load import CaptureMode
from bench.harness import append_result
from bench.stacks.hf_models import build_workload, model_specs, tiny, train_step


def run_mode(work, mode: str, args: argparse.Namespace, folder: Path, clock: GcClock) -> str:
    cap = None if mode == "off" else CaptureMode(work, mode, args, folder)

    def step(i: int) -> None:
        train_step(work, flush=None if cap is None else (lambda: cap.flush(i)))

    try:
        for i in range(args.warmup):
            step(i)
        gc.collect()  # the engine's slots and the warm-up: long-lived from here
        clock.key = mode
        with clock.installed():
            for i in range(args.warmup, args.warmup + args.steps):
                step(i)
        clock.key = None
    finally:
        if cap is not None:
            cap.close({})
    return f"{mode}: {clock.generations(mode)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--modes", default="off,mixed-deferred,mixed")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--small", type=int, default=16, help="4 KiB rows per layer (mixed)")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args(argv)
    # CaptureMode's settings (bench/capture/load.py), sized for the CPU.
    args.writers, args.ring_mb, args.staging_mb = 4, 256, 64
    args.gather_mb = args.gather_s = None
    spec = model_specs()[args.model]
    spec = dataclasses.replace(tiny(spec), layers=spec.layers)
    work = build_workload(spec, torch.device("cpu"))
    with tempfile.TemporaryDirectory(prefix="capture-gc-") as tmp:
        clock = GcClock()
        parts = [run_mode(work, m, args, Path(tmp), clock) for m in args.modes.split(",")]
    line = (
        f"{spec.name} ({spec.layers} layers, shrunk) on the CPU, one engine, "
        f"{args.steps} steps after a gc.collect(), collections per generation: " + "; ".join(parts)
    )
    print(line)
    if not args.no_append:
        append_result("capture_gc", line)
