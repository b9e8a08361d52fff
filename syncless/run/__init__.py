"""A run: its directory, its step records, and the sinks they go to.

The names below load on first use (PEP 562): ``syncless query``, ``check`` and
``--help`` import this package, and an eager ``Run`` would import torch with it
(``torch.distributed``, 1.5 s of a 1.9 s ``--help``; issue #21).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "RankInfo": "syncless.run.dist",
    "rank_info": "syncless.run.dist",
    "ParquetSink": "syncless.run.parquet",
    "StepRecord": "syncless.run.records",
    "StepRecords": "syncless.run.records",
    "check_metric_name": "syncless.run.records",
    "Run": "syncless.run.run",
    "RunDirError": "syncless.run.rundir",
    "TensorBoardSink": "syncless.run.sink_tensorboard",
    "WandbSink": "syncless.run.sink_wandb",
    "ConsoleSink": "syncless.run.sinks",
    "Sink": "syncless.run.sinks",
    "RunStore": "syncless.run.store",
    "UnreadableShardError": "syncless.run.store",
    "open": "syncless.run.store",
    "open_runs": "syncless.run.store",
}

__all__ = [
    "ConsoleSink",
    "ParquetSink",
    "RankInfo",
    "Run",
    "RunDirError",
    "RunStore",
    "Sink",
    "StepRecord",
    "StepRecords",
    "TensorBoardSink",
    "UnreadableShardError",
    "WandbSink",
    "check_metric_name",
    "open",
    "open_runs",
    "rank_info",
]

if TYPE_CHECKING:
    from syncless.run.dist import RankInfo, rank_info
    from syncless.run.parquet import ParquetSink
    from syncless.run.records import StepRecord, StepRecords, check_metric_name
    from syncless.run.run import Run
    from syncless.run.rundir import RunDirError
    from syncless.run.sink_tensorboard import TensorBoardSink
    from syncless.run.sink_wandb import WandbSink
    from syncless.run.sinks import ConsoleSink, Sink
    from syncless.run.store import RunStore, UnreadableShardError, open, open_runs


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'syncless.run' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
