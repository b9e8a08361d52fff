"""Run directories for the compare and overlay tests, written record by record with the
run store's own ParquetSink, so the tests know every number in them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from syncless.run import ParquetSink, StepRecords
from syncless.run.rundir import METRICS_DIR, write_run_json


def write_records(path: Path, records: dict[tuple[int, int, str], float],
                  info: dict[str, Any]) -> Path:  # fmt: skip
    """A run directory at ``path`` with ``run.json`` ``info`` and every (step, rank, name)
    -> value of ``records``, one shard per rank."""
    path.mkdir(parents=True)
    write_run_json(path, info)
    for rank in sorted({r for _, r, _ in records}):
        sink = ParquetSink(path / METRICS_DIR, rank, flush_interval_s=3600)
        batch = StepRecords()
        for (step, r, name), value in records.items():
            if r == rank:
                batch.add(path.name, step, rank, [name], [value], 1000.0 + step)
        sink.write(batch)
        sink.close()
    return path


def unrelated_run(path: Path) -> Path:
    """A run sharing no metric with a demo-like run: one eval accuracy, nothing else."""
    info = {"name": path.name, "world_size": 1}
    return write_records(path, {(0, 0, "eval/step/accuracy"): 0.5}, info)
