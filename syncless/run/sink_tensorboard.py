"""Step records as TensorBoard scalars, and vector metrics as histograms."""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from syncless.run.records import StepRecords
from syncless.run.sink_thread import ThreadedSink

# A vector metric is stored one record per element: `<prefix>/head_2`, `<prefix>/expert_5`.
VECTOR_ELEMENT = re.compile(r"^(?P<prefix>.+)/(?:head|expert)_\d+$")


def _file_writer() -> Any:
    try:
        # torch.utils.tensorboard needs the tensorboard package; torch itself is here.
        from torch.utils.tensorboard.writer import FileWriter
    except ImportError as e:
        raise ImportError(
            'TensorBoardSink needs tensorboard: pip install "syncless[tensorboard]"'
        ) from e
    return FileWriter


class TensorBoardSink(ThreadedSink):
    """Writes every record as a TensorBoard scalar, and each vector metric as a histogram.

    A record becomes the scalar ``name`` at global step ``step``, with the record's
    wall time. A vector metric comes as one record per element (``<prefix>/head_N``,
    ``<prefix>/expert_N``). Its elements at one step also become one histogram under
    ``<prefix>``. A vector's scalars need one chart per head or expert. The histogram
    shows their spread over steps in one chart: an expert whose load runs away, a head
    whose logits grow apart from the others.

    Example::

        with Run(sinks=[TensorBoardSink("runs/tb")]) as run:
            run.log(0, {"train/step/loss": 2.5})
        # tensorboard --logdir runs/tb

    Args:
        logdir: the directory of the event files (created if missing).
        flush_secs: how often the writer's own thread flushes events to disk.
    """

    def __init__(self, logdir: str | os.PathLike, flush_secs: float = 30.0) -> None:
        # Checked here, on the caller's thread: a missing extra is a setup error.
        self._writer_class = _file_writer()
        super().__init__(thread_name="syncless-tensorboard")
        self.logdir = Path(logdir)
        self.flush_secs = flush_secs
        self.writer: Any = None

    def open(self) -> None:
        self.writer = self._writer_class(str(self.logdir), flush_secs=self.flush_secs)

    def consume(self, records: StepRecords) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # One event per (step, wall time) holds its scalars and histograms: 1,536
        # monitor records took 71 ms with SummaryWriter.add_scalar per record and 20 ms
        # more for torch's histogram helper per vector family, all Python holding the
        # GIL the training thread needs (bench/store/sink_cost.py, bench/RESULTS.md).
        events: dict[tuple[int, float], list[Any]] = defaultdict(list)
        vectors: dict[tuple[int, float, str], list[float]] = defaultdict(list)
        for _, step, _, names, values, time in records.chunks():
            for name, value in zip(names, values, strict=True):
                # Lagged records (a monitor's step s after step s + 1) are fine:
                # TensorBoard orders a tag's points by step when it reads them.
                events[(step, time)].append(Summary.Value(tag=name, simple_value=value))
                element = VECTOR_ELEMENT.match(name)
                if element is not None:
                    vectors[(step, time, element["prefix"])].append(value)
        # A monitor readout emits all elements of one step together, in one batch.
        for (step, time, prefix), values in vectors.items():
            events[(step, time)].append(Summary.Value(tag=prefix, histo=_histogram(values)))
        for (step, time), values in events.items():
            self.writer.add_summary(Summary(value=values), step, time)

    def finish(self) -> None:
        self.writer.close()  # flushes the events still queued


def _histogram(values: list[float]) -> Any:
    """TensorBoard's histogram of a vector's elements, one bucket per element up to 64."""
    from tensorboard.compat.proto.summary_pb2 import HistogramProto

    v = np.asarray(values, dtype=np.float64)
    counts, edges = np.histogram(v, bins=min(len(v), 64))
    return HistogramProto(
        min=float(v.min()),
        max=float(v.max()),
        num=float(len(v)),
        sum=float(v.sum()),
        sum_squares=float(v @ v),
        bucket_limit=edges[1:].tolist(),
        bucket=counts.astype(np.float64).tolist(),
    )
