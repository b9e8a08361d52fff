"""A run: one training job's directory, identity and record stream."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch.distributed as dist

from syncless.errors import UsageError
from syncless.run.dist import RankInfo, rank_info
from syncless.run.parquet import ParquetSink
from syncless.run.placement import here, write_placement
from syncless.run.records import StepRecord, StepRecords, check_metric_name
from syncless.run.rundir import (
    DEFAULT_ROOT,
    METRICS_DIR,
    RunDirError,
    claim_run_dir,
    default_run_dir,
    last_step,
    make_unique_dir,
    new_segment,
    set_first_step,
    start_segment,
)
from syncless.run.sinks import Sink
from syncless.run.storage import RunPath, is_remote, run_path


class _Claim(NamedTuple):
    """Rank 0's answer, broadcast to every rank: the directory, or why there is none."""

    path: str | None
    next_step: int = 0
    error: str | None = None
    usage: bool = False  # error is a UsageError's message, meant for the user


class Run:
    """The run directory of this job plus the sinks every record goes to.

    Every rank creates a ``Run``. Rank 0 claims the directory and writes ``run.json``;
    under torch.distributed its choice is broadcast once, so all ranks agree even across
    nodes. Each rank writes its own Parquet shards.

    ``run_dir`` and ``root`` may be URLs (``s3://bucket/runs/x``, any fsspec protocol;
    ``pip install "syncless[fsspec]"``): the run is written to the object store with
    the same guarantees (syncless.run.storage, docs/run.md).

    Every run gets a directory of its own. A generated name (``runs/<time>-<name>``)
    that exists already gets a ``-2``, ``-3``, ... suffix. A ``run_dir`` that already
    holds something is refused, unless ``resume=True`` and it holds a run: then this
    start is appended to ``run.json``'s ``segments`` and ``next_step`` is the step after
    the last one stored.

    A sink that raises never breaks the training step: the error is counted per sink
    (``run/self/<Sink>_errors_count`` in later batches), reported once on stderr, and
    the sink is dropped after ``max_sink_errors`` failures. ``strict=True`` raises
    instead. An OSError while creating the directory or writing ``run.json`` raises
    :class:`~syncless.run.RunDirError`: the path and the reason in one line.

    Example::

        with Run(name="my-job", config={"lr": 3e-4}) as run:
            run.log(0, {"train/step/loss": 2.5})
    """

    def __init__(
        self,
        name: str = "run",
        config: Mapping[str, Any] | None = None,
        run_dir: str | os.PathLike | None = None,
        root: str | os.PathLike = DEFAULT_ROOT,
        sinks: Sequence[Sink] = (),
        flush_interval_s: float = 10.0,
        strict: bool = False,
        max_sink_errors: int = 10,
        ranks: RankInfo | None = None,
        resume: bool = False,
    ) -> None:
        if resume and run_dir is None:
            raise UsageError("Run(resume=True) needs run_dir: the directory of the run to resume")
        self.ranks = ranks or rank_info()
        self.strict = strict
        self.max_sink_errors = max_sink_errors
        target = run_path(run_dir) if run_dir is not None else None
        self.dir, self.next_step = self._open_dir(name, dict(config or {}), target, root, resume)
        self.name = self.dir.name
        self.parquet = ParquetSink(
            self.dir / METRICS_DIR, self.ranks.rank, flush_interval_s=flush_interval_s
        )
        self.sinks: list[Sink] = [self.parquet, *sinks]
        self.sink_errors: dict[str, int] = {}
        self._first_step_unknown = self.ranks.is_main  # run.json's segment waits for it
        self._closed = False
        self._write_placement()

    def _write_placement(self) -> None:
        # Where this rank runs, for the verdicts that name it (syncless.run.placement).
        try:
            write_placement(self.dir, here(self.ranks))
        except Exception as e:
            if self.strict:
                raise
            print(f"syncless: could not record this rank's host in the run ({e})", file=sys.stderr)

    def _open_dir(
        self,
        name: str,
        config: dict[str, Any],
        run_dir: RunPath | None,
        root: str | os.PathLike,
        resume: bool,
    ) -> tuple[RunPath, int]:
        """(directory, next step) as rank 0 decided; its error raised on every rank."""
        grouped = self.ranks.world_size > 1 and dist.is_available() and dist.is_initialized()
        error: Exception | None = None
        if self.ranks.is_main:
            try:
                claim = self._claim(name, config, run_dir, root, resume)
            except Exception as e:
                error, claim = e, _Claim(None, error=str(e), usage=isinstance(e, UsageError))
        elif grouped:
            claim = _Claim(None)  # rank 0's, once broadcast
        elif run_dir is None:
            raise UsageError(
                f"rank {self.ranks.rank} of {self.ranks.world_size} cannot learn rank 0's run "
                "directory without torch.distributed: call init_process_group() before "
                "creating the Run, or pass run_dir"
            )
        else:
            stored = last_step(run_dir) if resume and run_dir.is_dir() else None
            claim = _Claim(str(run_dir), 0 if stored is None else stored + 1)
        if grouped:
            # Cold path, once per run: rank 0's claim names the directory for everyone.
            box = [claim]
            dist.broadcast_object_list(box, src=0)
            claim = box[0]
        if error is not None:
            raise error
        if claim.path is None:
            if claim.usage:
                raise UsageError(claim.error)
            raise RuntimeError(f"rank 0 could not open the run directory: {claim.error}")
        # The caller's own path where it is the one chosen: a UPath keeps its options.
        directory = run_dir if str(run_dir) == claim.path else run_path(claim.path)
        if is_remote(directory):
            return directory, claim.next_step  # an object store has no directories
        try:
            directory.mkdir(parents=True, exist_ok=True)  # a node without rank 0's disk
        except OSError as e:
            raise RunDirError("create the run directory", directory, e) from e
        return directory, claim.next_step

    def _claim(
        self,
        name: str,
        config: dict[str, Any],
        run_dir: RunPath | None,
        root: str | os.PathLike,
        resume: bool,
    ) -> _Claim:
        if run_dir is None:
            path, resumed = make_unique_dir(default_run_dir(name, root)), False
        else:
            path, resumed = run_dir, claim_run_dir(run_dir, resume)
        stored = last_step(path) if resumed else None
        start_segment(path, path.name, new_segment(self.ranks.world_size, config), resumed)
        return _Claim(str(path), 0 if stored is None else stored + 1)

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
        if self._first_step_unknown and batch:
            self._record_first_step(batch[0].step)
        for sink in list(self.sinks):
            try:
                sink.write(batch)
            except Exception as e:
                self._sink_failed(sink, e)

    def _record_first_step(self, step: int) -> None:
        # Once per segment, on rank 0: a read and a rewrite of run.json (~1 ms).
        self._first_step_unknown = False
        try:
            set_first_step(self.dir, step)
        except Exception as e:
            if self.strict:
                raise
            print(f"syncless: could not record the first step in run.json ({e})", file=sys.stderr)

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
