"""A run: one training job's directory, identity and record stream."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from syncless.run.dist import RankInfo, rank_info
from syncless.run.parquet import ParquetSink
from syncless.run.records import StepRecord, StepRecords, check_metric_name
from syncless.run.rundir import METRICS_DIR, default_run_dir, environment, write_run_json
from syncless.run.sinks import Sink


class Run:
    """The run directory of this job plus the sinks every record goes to.

    Every rank creates a ``Run``; rank 0 picks the directory (under torch.distributed it
    is broadcast once at creation so all ranks agree even across nodes) and writes
    ``run.json``; each rank writes its own Parquet shards.

    A sink that raises never breaks the training step: the error is counted per sink
    (``run/self/<Sink>_errors_count`` in later batches), reported once on stderr, and
    the sink is dropped after ``max_sink_errors`` failures. ``strict=True`` raises
    instead.
    """

    def __init__(
        self,
        name: str = "run",
        config: Mapping[str, Any] | None = None,
        run_dir: str | os.PathLike | None = None,
        root: str | os.PathLike = "runs",
        sinks: Sequence[Sink] = (),
        flush_interval_s: float = 10.0,
        strict: bool = False,
        max_sink_errors: int = 10,
        ranks: RankInfo | None = None,
    ) -> None:
        self.ranks = ranks or rank_info()
        self.strict = strict
        self.max_sink_errors = max_sink_errors
        self.dir = self._agree_on_dir(Path(run_dir) if run_dir else default_run_dir(name, root))
        self.name = self.dir.name
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.ranks.is_main:
            write_run_json(
                self.dir,
                {
                    "name": self.name,
                    "start_time": time.time(),
                    "world_size": self.ranks.world_size,
                    "config": dict(config or {}),
                    "env": environment(),
                },
            )
        self.parquet = ParquetSink(
            self.dir / METRICS_DIR, self.ranks.rank, flush_interval_s=flush_interval_s
        )
        self.sinks: list[Sink] = [self.parquet, *sinks]
        self.sink_errors: dict[str, int] = {}
        self._closed = False

    def _agree_on_dir(self, proposed: Path) -> Path:
        if self.ranks.world_size > 1 and dist.is_available() and dist.is_initialized():
            # Cold path, once per run: rank 0's clock names the directory for everyone.
            box = [str(proposed)]
            dist.broadcast_object_list(box, src=0)
            return Path(box[0])
        return proposed

    def records(self, step: int, values: Mapping[str, float]) -> list[StepRecord]:
        """StepRecords for ``values`` at ``step`` on this rank, names checked."""
        now = time.time()
        rank = self.ranks.rank
        return [
            StepRecord(self.name, step, rank, check_metric_name(k), float(v), now)
            for k, v in values.items()
        ]

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Emit host-side numbers (floats, not tensors: read them back before logging)."""
        self.emit(self.records(step, values))

    def emit(self, records: Iterable[StepRecord]) -> None:
        """Send a batch of records to every sink (a :class:`StepRecords` as it is: its
        columns go to Parquet without a tuple per record)."""
        batch = StepRecords()
        batch.extend(records)
        if self.sink_errors:
            batch.extend(
                self.records(
                    batch[0].step if batch else -1,
                    {f"run/self/{k}_errors_count": v for k, v in self.sink_errors.items()},
                )
            )
        for sink in list(self.sinks):
            try:
                sink.write(batch)
            except Exception as e:
                self._sink_failed(sink, e)

    def _sink_failed(self, sink: Sink, err: Exception) -> None:
        if self.strict:
            raise err
        key = type(sink).__name__
        n = self.sink_errors[key] = self.sink_errors.get(key, 0) + 1
        if n == 1:
            print(f"syncless: sink {key} failed ({err}); counting further errors", file=sys.stderr)
        if n >= self.max_sink_errors and sink in self.sinks:
            self.sinks.remove(sink)
            print(f"syncless: sink {key} dropped after {n} errors", file=sys.stderr)

    def flush(self) -> None:
        """Write every record emitted so far to this rank's shards and wait for it."""
        try:
            self.parquet.flush()
        except Exception as e:
            self._sink_failed(self.parquet, e)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:
                self._sink_failed(sink, e)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
