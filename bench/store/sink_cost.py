"""Writer-thread time of the TensorBoard and wandb sinks per step of monitor records.

Both sinks only enqueue on the training thread; their writer thread then spends this
much Python per step, holding the GIL the training thread needs. A 16-layer model
with 6 per-head metrics of 16 heads is 1,536 records a step. TensorBoard is timed as
the sink writes (one event per emit) and the naive way (``SummaryWriter.add_scalar``
per record), wandb offline (one ``log`` row per step).

    python -m bench.store sink_cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from bench.harness import append_result
from syncless.run.records import StepRecords

LAYERS, METRICS, HEADS = 16, 6, 16
NAMES = [
    f"monitors/layer_{i:02d}/m{j}_max/head_{k}"
    for i in range(LAYERS)
    for j in range(METRICS)
    for k in range(HEADS)
]


def batch(step: int) -> StepRecords:
    records = StepRecords()
    records.add("bench", step, 0, NAMES, [float(i % 97) for i in range(len(NAMES))], 1.0)
    return records


def ms_per_step(consume: Callable[[StepRecords], None], steps: int) -> float:
    consume(batch(0))  # the first opens files and imports
    times = []
    for step in range(1, steps + 1):
        records = batch(step)
        start = time.perf_counter()
        consume(records)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-append", action="store_true", help="skip bench/RESULTS.md")
    args = parser.parse_args(argv)
    from torch.utils.tensorboard import SummaryWriter

    from syncless.run import TensorBoardSink, WandbSink

    tmp = tempfile.mkdtemp()
    tb = TensorBoardSink(os.path.join(tmp, "tb"))
    tb.open()
    naive = SummaryWriter(os.path.join(tmp, "naive"))

    def add_scalars(records: StepRecords) -> None:
        for _, step, _, names, values, when in records.chunks():
            for name, value in zip(names, values, strict=True):
                naive.add_scalar(name, value, global_step=step, walltime=when)

    os.environ.update(WANDB_SILENT="true", WANDB_DIR=tmp)
    wb = WandbSink(project="syncless-bench", mode="offline", dir=tmp)
    wb.open()
    times = {
        "tensorboard sink": ms_per_step(tb.consume, args.steps),
        "tensorboard add_scalar per record": ms_per_step(add_scalars, args.steps),
        "wandb sink (offline)": ms_per_step(wb.consume, args.steps),
    }
    tb.finish()
    naive.close()
    wb.finish()
    result = f"writer-thread ms per step of {len(NAMES)} records, median of {args.steps}: " + (
        ", ".join(f"{name} {ms:.1f}" for name, ms in times.items())
    )
    print(result)
    if not args.no_append:
        print(append_result("sink_cost", result))
