"""Append one benchmark result line to bench/RESULTS.md (date, device, torch, commit)."""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"{n}x {torch.cuda.get_device_name()}"
    return f"CPU ({os.cpu_count()} cores)"


def commit() -> str:
    env = os.environ.get("SYNCLESS_COMMIT")  # the device machine's copy has no .git
    if env:
        return env
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    # RESULTS.md itself changes with every append: not a code change. Untracked files
    # count (a new benchmark script is part of what was measured).
    status = ["git", "status", "--porcelain", "--", ".", ":!*RESULTS.md"]
    dirty = subprocess.run(status, capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def metric_values(run_dir: Path, name: str, first_step: int = 0, rank: int = 0) -> list[float]:
    """One metric of one rank from a run's shards, in step order (pyarrow only: the GPU
    image has no DuckDB)."""
    import pyarrow.parquet as pq

    rows = []
    for shard in sorted((Path(run_dir) / "metrics").glob(f"rank{rank:05d}-*.parquet")):
        rows += [
            (r["step"], r["value"])
            for r in pq.read_table(shard).to_pylist()
            if r["name"] == name and r["step"] >= first_step
        ]
    return [v for _, v in sorted(rows)]


def append_result(bench: str, result: str, path: Path | None = None) -> str:
    import torch

    line = (
        f"- {datetime.date.today().isoformat()} | {device_name()} | torch {torch.__version__} | "
        f"{commit()} | {bench} | {result}"
    )
    target = path or Path(os.environ.get("SYNCLESS_RESULTS", RESULTS))
    with target.open("a") as f:
        f.write(line + "\n")
    return line


def syncless_argv() -> list[str]:
    """The ``syncless`` command as users run it: the script pip installed next to this
    Python, else ``python -m syncless.cli``."""
    import sys

    script = Path(sys.executable).with_name("syncless")
    return [str(script)] if script.exists() else [sys.executable, "-m", "syncless.cli"]
