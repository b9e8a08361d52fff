"""A run: its directory, its step records, and the sinks they go to."""

from syncless.run.dist import RankInfo, rank_info
from syncless.run.parquet import ParquetSink
from syncless.run.records import StepRecord, StepRecords, check_metric_name
from syncless.run.run import Run
from syncless.run.sinks import ConsoleSink, Sink
from syncless.run.store import RunStore, open

__all__ = [
    "ConsoleSink",
    "ParquetSink",
    "RankInfo",
    "Run",
    "RunStore",
    "Sink",
    "StepRecord",
    "StepRecords",
    "check_metric_name",
    "open",
    "rank_info",
]
