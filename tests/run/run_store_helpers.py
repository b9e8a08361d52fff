"""Run directories written record by record, so tests know every number in them."""

from __future__ import annotations

from pathlib import Path

from syncless.run import ParquetSink, StepRecord
from syncless.run.rundir import METRICS_DIR, write_run_json


def make_run(run_dir: Path, world_size: int = 1) -> Path:
    """An empty run directory: ``run.json`` and nothing else."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_json(run_dir, {"name": run_dir.name, "world_size": world_size})
    return run_dir


def write_shards(run_dir: Path, rank: int, shards: list[list[int]], names: int = 2) -> list[Path]:
    """One shard per list of steps, written by the run store's own ParquetSink; each step
    gets ``names`` records. Returns the shard paths in order."""
    sink = ParquetSink(run_dir / METRICS_DIR, rank, flush_interval_s=3600)
    for steps in shards:
        sink.write(
            [
                StepRecord("test", step, rank, f"test/step/m{i}", step + i / 10, 1000.0 + step)
                for step in steps
                for i in range(names)
            ]
        )
        sink.flush()
    sink.close()
    return sorted((run_dir / METRICS_DIR).glob(f"rank{rank:05d}-*.parquet"))[-len(shards) :]


def truncate(path: Path) -> None:
    """Cut a file to half its size, as a full disk or a bad copy would."""
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)
