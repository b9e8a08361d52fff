"""How long one full Python garbage collection stalls a process that trains a model.

A full (generation 2) collection walks every object the collector tracks, so its
pause grows with what the process has imported and built (transformers, the model's
modules and parameters), not with the tensors' bytes. The capture engine allocates a
few tracked objects per record (its records and their staging views), which makes
collections more frequent: on the H200, capturing every layer of Llama-1B with 256
small rows raised them from 0.1 to about 2 a step, and one full collection there took
253 ms (bench/capture_load.py, f6c7dfb). This times ``gc.collect()`` with the model of
``bench/hf_models.py`` built, then again after ``gc.freeze()``, which moves every
object alive into a generation no collection walks.

    python bench/gc_pause.py                  # llama-1b's 16 layers, shrunk (CPU)
    python bench/gc_pause.py --full           # llama-1b itself (needs ~16 GB)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time

import torch
from hf_models import build_workload, model_specs, tiny, train_step  # bench/ on sys.path
from results import append_result


def collect_ms(reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--full", action="store_true", help="the model's own sizes")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    spec = model_specs()[args.model]
    if not args.full:
        spec = dataclasses.replace(tiny(spec), layers=spec.layers)
    device = torch.device("cuda" if torch.cuda.is_available() and args.full else "cpu")
    work = build_workload(spec, device)
    for _ in range(2):
        train_step(work)  # autograd and the optimizer's state exist, as in training
    tracked = len(gc.get_objects())
    before = collect_ms(args.reps)
    gc.freeze()
    frozen = collect_ms(args.reps)
    gc.unfreeze()
    line = (
        f"{spec.name} ({spec.layers} layers{'' if args.full else ', shrunk'}) built and "
        f"trained 2 steps on {device.type}, {tracked} objects tracked: gc.collect() "
        f"{before:.1f} ms (median of {args.reps}); after gc.freeze() {frozen:.2f} ms"
    )
    print(line)
    if not args.no_append:
        append_result("gc_pause", line)


if __name__ == "__main__":
    main()
