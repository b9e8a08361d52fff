"""What ``Profiler.report()`` returns: step records, the rows, the late ranks and the table."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from rich.table import Table

from syncless.profile.graph_sections import UNTIMED_RECORD
from syncless.profile.names import metric
from syncless.profile.stragglers import CLOCK_SECTION, StragglerDetector, Verdict
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
    # Open straggler verdicts after this report (syncless.profile.stragglers).
    stragglers: list[Verdict] = field(default_factory=list)

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
    for key, value in (me.sensors or {}).items():
        out[metric("gpu_sensors", key)] = value
    return out


def straggler_values(
    detector: StragglerDetector, verdicts: list[Verdict], rank: int, lead: bool
) -> dict[str, float]:
    """This rank's straggler records: its window score per scored section
    (``straggler_score``, dimensionless) and, while a verdict on it is open, the
    verdict: ``straggler_verdict_first_step``, ``_last_step``, ``_score`` (and
    ``_clock_mhz`` for ``gpu_clock``). ``syncless stragglers`` reads these back with one
    filter on ``/straggler_verdict_``: the scores of every rank and section are not
    scanned (on 1,024 ranks they are 1M records of a 5M-record run). The lead rank (the lowest) also records, per
    section with a verdict, the rank with the lowest score: ``straggler_rank``,
    ``straggler_rank_score`` and ``straggler_rank_first_step`` (what the demo's live
    view reads, which sees rank 0's records only).

    At 1,024 ranks x 50 sections this is 50 records per rank per report, beside the
    4 to 6 the profiler already writes per section: the whole score matrix is kept
    (the report's heat map reads it), written by the rank it belongs to.
    """
    out: dict[str, float] = {}
    row = int(np.searchsorted(detector.ranks, rank))
    if row < len(detector.ranks) and detector.ranks[row] == rank:
        for section, score in zip(detector.sections, detector.scores[row].tolist(), strict=True):
            if score == score:  # not NaN: the rank ran it
                out[metric(section, "straggler_score")] = score
        if (
            detector.clock_scores is not None
            and detector.clock_scores[row] == detector.clock_scores[row]
        ):
            out[metric(CLOCK_SECTION, "straggler_score")] = float(detector.clock_scores[row])
    worst: dict[str, Verdict] = {}
    for v in verdicts:
        if v.rank == rank:
            out[metric(v.section, "straggler_verdict_first_step")] = float(v.first_step)
            out[metric(v.section, "straggler_verdict_last_step")] = float(v.last_step)
            out[metric(v.section, "straggler_verdict_score")] = v.score  # dimensionless
            if v.clock_mhz is not None:
                out[metric(v.section, "straggler_verdict_clock_mhz")] = v.clock_mhz
        if v.section not in worst or v.score < worst[v.section].score:
            worst[v.section] = v
    if lead:
        for section, v in worst.items():
            out[metric(section, "straggler_rank")] = float(v.rank)
            out[metric(section, "straggler_rank_score")] = v.score
            out[metric(section, "straggler_rank_first_step")] = float(v.first_step)
    return out


def records(run: str, step: int, rank: int, vals: dict[str, float]) -> list[StepRecord]:
    now = time.time()
    return [StepRecord(run, step, rank, k, float(v), now) for k, v in vals.items()]
