"""Per-rank window summaries and the cross-rank view built from one gather of them."""

from __future__ import annotations

import statistics
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


@dataclass
class SectionTotals:
    """One section's totals over a report window on one rank (picklable, gathered)."""

    name: str  # display name: 'attn', or 'moe_a2a/rendezvous' for a collective part
    category: str
    kind: str  # 'section' | 'collective' | 'part'
    parent: str | None
    time_ns: float = 0.0
    calls: int = 0
    bytes: int = 0


class StepMedians(NamedTuple):
    """Each plain section's median ns per step over a report window, on one rank.

    ``names`` are the rank's plain sections in its declaration order, ``raw`` their
    medians as float64 bytes (NaN: not run in the window). ``layout`` fingerprints
    ``names`` (CRC-32, the same on every rank: Python's ``hash`` of a str differs by
    process). So the report reads 1,024 ranks of one layout as one joined buffer, not
    51,200 dict lookups (issue #47's 5 ms scoring budget); bytes, not an ndarray each,
    because joining 1,024 of them is one copy (np.stack of 1,024 arrays: 0.6 ms).
    """

    names: tuple[str, ...]
    raw: bytes
    layout: int

    @classmethod
    def of(cls, names: tuple[str, ...], ns: np.ndarray) -> StepMedians:
        return cls(names, np.asarray(ns, dtype=np.float64).tobytes(), layout_of(names))

    @property
    def ns(self) -> np.ndarray:
        return np.frombuffer(self.raw, dtype=np.float64)

    def as_dict(self) -> dict[str, float]:
        """The sections that ran, by name."""
        return {n: v for n, v in zip(self.names, self.ns.tolist(), strict=True) if v == v}


def layout_of(names: tuple[str, ...]) -> int:
    """A fingerprint of ``names``, equal on every rank for equal names."""
    return zlib.crc32("\n".join(names).encode())


@dataclass
class RankSummary:
    """What one rank contributes to a report: one object, gathered once per report."""

    rank: int
    steps: int
    step_ns: float
    self_ns: float
    misuse: int
    sections: dict[str, SectionTotals] = field(default_factory=dict)
    # Spans captured into CUDA graphs that no replay times (since the profiler started).
    untimed_graph_spans: int = 0
    # GPU sensors over the window (syncless.profile.gpu_sensors.SensorSummary as a
    # dict: sm_clock_mhz, sm_clock_min_mhz, ...); None without NVML.
    sensors: dict[str, float] | None = None
    # Each plain section's median time per step over the window, where the profiler
    # kept per-step times (syncless.profile.stragglers.StepTimes).
    step_medians: StepMedians | None = None
    # Where the rank runs: the host name and its GPU (``cuda:3 0000:3b:00.0``, the PCI
    # bus id, which NVML and nvidia-smi name too; "" on the CPU). An on-call engineer
    # acts on a node and a GPU, not on a rank number.
    host: str = ""
    device: str = ""


@dataclass
class Row:
    """One line of the table, for the reporting rank, with the across-rank spread."""

    name: str
    category: str
    kind: str
    depth: int
    ms_per_step: float
    pct_of_step: float
    calls_per_step: float
    us_per_call: float
    gb_per_s: float | None
    rank_min_ms: float
    rank_median_ms: float
    rank_max_ms: float
    max_rank: int


@dataclass
class Late:
    """For one collective with a rendezvous: who arrived last and the likely reason."""

    collective: str
    late_rank: int
    wait_ms_per_call: list[float]  # per rank: its own mean rendezvous wait per call
    culprit: str | None  # the late rank's section furthest above the others' median
    culprit_excess_ms: float  # per step, late rank minus median of the other ranks


def ms_per_step(summary: RankSummary, name: str) -> float:
    """``name``'s time per step on this rank (0 where the rank never ran it)."""
    sec = summary.sections.get(name)
    return 0.0 if sec is None or summary.steps == 0 else sec.time_ns / 1e6 / summary.steps


def _order(summaries: list[RankSummary], first: RankSummary) -> list[tuple[str, int]]:
    """Section names, parents before children (depth-first), in first-seen order."""
    meta: dict[str, SectionTotals] = {}
    for s in [first, *summaries]:
        for name, sec in s.sections.items():
            meta.setdefault(name, sec)
    children: dict[str | None, list[str]] = {}
    for name, sec in meta.items():
        parent = sec.parent if sec.parent in meta else None
        children.setdefault(parent, []).append(name)
    out: list[tuple[str, int]] = []
    stack = [(name, 0) for name in reversed(children.get(None, []))]
    while stack:
        name, depth = stack.pop()
        out.append((name, depth))
        stack.extend((c, depth + 1) for c in reversed(children.get(name, [])))
    return out


def rows(summaries: list[RankSummary], rank_index: int) -> list[Row]:
    """The table rows seen from ``summaries[rank_index]``, spread over all summaries."""
    me = summaries[rank_index]
    step_ms = me.step_ns / 1e6 / me.steps if me.steps else 0.0
    out: list[Row] = []
    for name, depth in _order(summaries, me):
        sec = me.sections.get(name)
        meta = sec or next(s.sections[name] for s in summaries if name in s.sections)
        ms = ms_per_step(me, name)
        calls = sec.calls if sec else 0
        per_rank = [ms_per_step(s, name) for s in summaries]
        max_i = max(range(len(per_rank)), key=per_rank.__getitem__)
        gbps = None
        if sec is not None and sec.bytes and sec.time_ns > 0:
            gbps = sec.bytes / sec.time_ns  # bytes per ns == GB/s
        out.append(
            Row(
                name=name,
                category=meta.category,
                kind=meta.kind,
                depth=depth,
                ms_per_step=ms,
                pct_of_step=100.0 * ms / step_ms if step_ms > 0 else 0.0,
                calls_per_step=calls / me.steps if me.steps else 0.0,
                us_per_call=(sec.time_ns / 1e3 / calls) if sec and calls else 0.0,
                gb_per_s=gbps,
                rank_min_ms=min(per_rank),
                rank_median_ms=statistics.median(per_rank),
                rank_max_ms=per_rank[max_i],
                max_rank=summaries[max_i].rank,
            )
        )
    return out


def _inside(names: dict[str, SectionTotals], child: str, ancestor: str) -> bool:
    parent = names[child].parent
    while parent is not None and parent in names:
        if parent == ancestor:
            return True
        parent = names[parent].parent
    return False


def late_ranks(summaries: list[RankSummary]) -> list[Late]:
    """For each collective with rendezvous waits: the late rank and its culprit section.

    The late rank is the one whose *own* rendezvous wait is smallest: it arrived last,
    so it waited least. The culprit is the plain section (not a collective or its
    parts) whose time per step on the late rank exceeds the median of the other ranks
    by the most, over the same window of steps; a nested section that holds at least
    90% of its parent's excess is named instead of the parent. Needs two ranks or more.
    """
    if len(summaries) < 2:
        return []
    out: list[Late] = []
    names = {n: sec for s in summaries for n, sec in s.sections.items()}
    for name, sec in names.items():
        if sec.kind != "collective":
            continue
        part = f"{name}/rendezvous"
        if not any(part in s.sections and s.sections[part].calls for s in summaries):
            continue
        waits = []
        for s in summaries:
            p = s.sections.get(part)
            waits.append(p.time_ns / 1e6 / p.calls if p and p.calls else 0.0)
        late_i = min(range(len(waits)), key=waits.__getitem__)
        late = summaries[late_i]
        others = [s for i, s in enumerate(summaries) if i != late_i]
        culprit, excess = None, 0.0
        for cand, csec in names.items():
            if csec.kind != "section":
                continue
            diff = ms_per_step(late, cand) - statistics.median(ms_per_step(o, cand) for o in others)
            # A child holding most of its parent's excess is the better answer.
            if diff > excess or (
                culprit is not None and diff >= 0.9 * excess and _inside(names, cand, culprit)
            ):
                culprit, excess = cand, diff
        out.append(Late(name, late.rank, waits, culprit, excess))
    return out
