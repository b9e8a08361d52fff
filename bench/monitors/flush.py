"""Host time of the monitor flush on the training thread, for the demo large schema.

Attaches every monitor to a demo model with the large preset's layer, head and expert
counts (tiny expert and sequence sizes: the schema, not the compute, sets the flush's
cost: 1,549 records per step), runs a few steps, then times on the same readout:

* ``handle.step()``: flush + decode + records + derives, what a training step pays;
* decode + records as shipped (one flat pass, syncless.metrics.readout);
* the same decode + records as a per-key Python loop (the implementation before
  d551bcf), written here as the baseline, so the ratio is measured in one run.

    python -m bench.monitors flush
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from bench.harness import append_result
from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.metrics.readout import decode
from syncless.monitors import MONITORS, attach, build
from syncless.run import Run
from syncless.run.parquet import SCHEMA, records_to_table
from syncless.run.records import StepRecord


def per_key_records(host: np.ndarray, specs, offsets, step: int) -> list[StepRecord]:
    """Decode and emit key by key: the loop the flat Layout replaced."""
    out = []
    for spec, (s, c, m) in zip(specs, offsets, strict=True):
        n = spec.size
        if spec.agg in ("mean", "sum"):
            total, count = host[s : s + n], host[c : c + n]
            with np.errstate(invalid="ignore", divide="ignore"):
                value = total.copy() if spec.agg == "sum" else total / count
            present = count > 0
        else:
            extreme = host[m : m + n]
            present = ~np.isneginf(extreme)
            value = -extreme if spec.agg == "min" else extreme.copy()
        if not present.any():
            continue
        chosen = value[present]
        summary = {"max": chosen.max, "min": chosen.min, "sum": chosen.sum}.get(
            spec.agg, chosen.mean
        )
        out.append(StepRecord("r", step, 0, spec.key, float(summary()), 0.0))
        if n > 1 and spec.emit_elements:
            width = len(str(n - 1))
            for i in np.flatnonzero(present):
                name = f"{spec.key}/{spec.element}_{i:0{width}d}"
                out.append(StepRecord("r", step, 0, name, float(value[i]), 0.0))
    return out


def records_to_table_from_tuples(records: list[StepRecord]) -> pa.Table:
    """The writer's conversion before StepRecords: a list per column from the tuples."""
    return pa.table(
        {
            "run": [r.run for r in records],
            "step": [r.step for r in records],
            "rank": [r.rank for r in records],
            "name": [r.name for r in records],
            "value": [float(r.value) for r in records],
            "time": [r.time for r in records],
        },
        schema=SCHEMA,
    )


def best_ms(fn, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    cfg = preset("large", expert_hidden=64, seq_len=32, batch_size=1)
    model = MoETransformer(cfg)
    init_weights(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (1, cfg.seq_len))
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(name="flush", run_dir=Path(tmp) / "run")
        handle = attach(model, build(list(MONITORS), optimizer=opt, every=1), run=run, budget=None)
        step_ms = []
        for step in range(12):
            logits, balance = model(tokens)
            (logits.float().square().mean() + balance).backward()
            opt.step()
            opt.zero_grad()
            start = time.perf_counter()
            records = handle.step(step)
            if step >= 2:
                step_ms.append((time.perf_counter() - start) * 1e3)
        ms = handle.metrics
        host = ms._host_np[0]
        flat_records = decode(1, host, ms._layout).records("r", 0, 0.0)
        loop_records = per_key_records(host, ms._specs, ms._offsets, 1)
        # the baseline must emit what the shipped code emits (globals aside: the old
        # loop decoded them separately), or the ratio compares different work
        names = {r.name for r in flat_records if "/global/" not in r.name}
        assert names == {r.name for r in loop_records if "/global/" not in r.name}
        flat = best_ms(lambda: decode(1, host, ms._layout).records("r", 0, 0.0))
        # The Parquet writer's conversion of one step's records, from columns (what a
        # flush emits) and from a tuple per record (what it emitted before).
        columns = decode(1, host, ms._layout).records("r", 0, 0.0)
        tuples = list(columns)
        arrow_columns = best_ms(lambda: records_to_table(columns))
        arrow_tuples = best_ms(lambda: records_to_table_from_tuples(tuples))
        loop = best_ms(lambda: per_key_records(host, ms._specs, ms._offsets, 1))
        handle.close()
        run.close()
    n = len(records)
    line = (
        f"demo large schema ({n} records/step), host ms on the training thread: "
        f"handle.step {statistics.median(step_ms):.2f}; decode+records flat {flat:.2f} vs "
        f"per-key loop {loop:.2f} (x{loop / flat:.1f}); Parquet writer's table per step "
        f"from columns {arrow_columns:.2f} vs from tuples {arrow_tuples:.2f}"
    )
    print(line)
    if not args.no_record:
        append_result("monitor_flush", line)
