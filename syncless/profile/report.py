"""What ``Profiler.report()`` returns: step records, the rows, the late ranks and the table."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from rich.table import Table

from syncless.profile.graph_sections import UNTIMED_RECORD
from syncless.profile.names import metric
from syncless.profile.summary import Late, RankSummary, Row
from syncless.run.records import StepRecord


@dataclass
class ProfileReport:
    """One report window. Iterating it yields its ``StepRecord``s (for ``Run.emit``)."""

    step: int
    steps: int  # steps in the window on this rank
    rows: list[Row]
    lates: list[Late]
    table: Table
    values: dict[str, float]  # metric name -> value on this rank (for ``Run.log``)
    records: list[StepRecord] = field(default_factory=list)

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def row(self, name: str) -> Row:
        """The row called ``name`` (a section, ``step``, or ``coll/rendezvous``)."""
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no row {name!r}; rows: {[r.name for r in self.rows]}")


def values(me: RankSummary, rows: list[Row], lates: list[Late]) -> dict[str, float]:
    """This rank's metric values for the window (per step unless the unit says count).

    Each section, collective and ``step`` row also gets its nesting: ``depth_count``
    (``Row.depth``: 0 for ``step`` and for the sections directly inside the step) and
    ``order_count`` (its position among these rows, depth-first; ``step`` is 0). A
    reader finds a row's parent without relying on storage order: the row at depth - 1
    with the largest order below its own (``syncless.report.nesting.parents``).
    """
    out: dict[str, float] = {}
    order = 0
    for r in rows:
        if r.kind == "part":
            coll, part = r.name.rsplit("/", 1)
            out[metric(coll, f"{part}_ms")] = r.ms_per_step
            continue
        out[metric(r.name, "time_ms")] = r.ms_per_step
        out[metric(r.name, "calls_count")] = r.calls_per_step
        out[metric(r.name, "depth_count")] = float(r.depth)
        out[metric(r.name, "order_count")] = float(order)
        order += 1
        if r.gb_per_s is not None:
            out[metric(r.name, "bandwidth_gb_per_s")] = r.gb_per_s
    steps = max(me.steps, 1)
    out[metric("self", "host_ms")] = me.self_ns / 1e6 / steps
    out[metric("self", "misuse_count")] = float(me.misuse)
    out[UNTIMED_RECORD] = float(me.untimed_graph_spans)
    for late in lates:
        # A rank id: dimensionless.
        out[metric(late.collective, "late_rank")] = float(late.late_rank)
    return out


def records(run: str, step: int, rank: int, vals: dict[str, float]) -> list[StepRecord]:
    now = time.time()
    return [StepRecord(run, step, rank, k, float(v), now) for k, v in vals.items()]
