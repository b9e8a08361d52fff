"""``syncless trace RUN_DIR [-o trace.json]``: the profiler's sections as a Chrome trace.

The profiler records, per report window and rank, each section's mean time per step
and its nesting (depth and depth-first order), without start times (``docs/profile.md``,
Records). So each window becomes one representative step: durations are measured,
positions within the step are reconstructed. :func:`trace_events` builds the events; ``run`` is
the command. The layout rule is in ``docs/report.md`` ("syncless trace").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NamedTuple

from syncless.report.nesting import parents, positions
from syncless.run.query_cli import warnings_on_stderr
from syncless.run.storage import RunPath, run_path, write_whole
from syncless.run.store import RunStore

__all__ = ["Slice", "layout", "run", "trace_events"]

_PROFILE = """
SELECT rank, step, name, value, time FROM metrics_written
WHERE name LIKE 'profile/%' ORDER BY rank, step, file, row
"""
PARTS = ("rendezvous", "transfer")  # laid end to end inside their collective
# Tracks (tid) of a rank's process: one per kind of slice, so a track's slices nest
# or follow each other, never partly overlap.
TRACKS = {"step": 0, "sections": 1, "collectives": 2, "collective enqueue (host)": 3}
_EPSILON_MS = 1e-6  # float slack when a child's time is compared with its parent's room


class Slice(NamedTuple):
    """One section placed in a step: start and duration in ms from the step's start."""

    name: str
    start_ms: float
    ms: float
    depth: int  # 0 at the top of the step, 1 inside a top-level section, ...


def layout(
    sections: list[tuple[str, float]],
    step_ms: float,
    nesting: dict[str, str | None] | None = None,
) -> list[Slice]:
    """Place sections (depth-first order, ms per step) inside a step of ``step_ms``.

    With ``nesting`` (name -> parent, from the profiler's records) each section starts
    where its previous sibling ended, its first child where it starts: the children of
    the whole step (parent ``None``) are laid end to end from 0, any depth deep.
    """
    if nesting is None:
        return _guess_layout(sections, step_ms)
    out: list[Slice] = []
    placed: dict[str, Slice] = {}
    cursor: dict[str | None, float] = {None: 0.0}  # parent -> where its next child starts
    for name, ms in sections:
        parent = nesting.get(name)
        if parent not in placed:
            parent = None  # the step, or a parent without a slice of its own
        start = cursor.get(parent, 0.0)
        cursor[parent] = start + ms
        cursor[name] = start
        depth = placed[parent].depth + 1 if parent is not None else 0
        placed[name] = Slice(name, start, ms, depth)
        out.append(placed[name])
    return out


def _guess_layout(sections: list[tuple[str, float]], step_ms: float) -> list[Slice]:
    """The fallback for runs recorded before the profiler wrote its nesting.

    The records are depth-first but carry no parent. A section goes inside the
    top-level section before it when it fits in that section's remaining room and
    laying everything from it onward end to end would overrun the step. Otherwise it
    starts where the previous top-level section ended. Nesting is one level deep.
    """
    out: list[Slice] = []
    top_end = 0.0
    room = 0.0  # what is left inside the last top-level section
    cursor = 0.0  # where its next child starts
    remaining = sum(ms for _, ms in sections)
    for name, ms in sections:
        overruns = top_end + remaining > step_ms + _EPSILON_MS
        if out and ms <= room + _EPSILON_MS and overruns:
            out.append(Slice(name, cursor, ms, 1))
            cursor += ms
            room -= ms
        else:
            out.append(Slice(name, top_end, ms, 0))
            cursor, room = top_end, ms
            top_end += ms
        remaining -= ms
    return out


def _event(name: str, rank: int, track: str, start_us: float, ms: float, **args: Any) -> dict:
    return {"name": name, "ph": "X", "ts": round(start_us, 3), "dur": round(ms * 1e3, 3),
            "pid": rank, "tid": TRACKS[track], "cat": track, "args": args}  # fmt: skip


def _window_events(rank: int, step: int, end_us: float, values: dict[str, float]) -> list[dict]:
    """One report window of one rank: a step slice ending at the report's time."""
    step_ms = values["profile/step/time_ms"]
    start_us = end_us - step_ms * 1e3
    note = f"mean per step of the report window ending at step {step}"
    events = [_event(f"step {step}", rank, "step", start_us, step_ms, note=note)]
    names = [n.split("/")[1] for n in values if n.endswith("/time_ms") and n.count("/") == 2]
    names = [s for s in names if s not in ("step", "self")]
    where = positions(values)
    nesting = None  # a run recorded before the nesting records: layout guesses
    if names and all(s in where for s in names):
        names.sort(key=lambda s: where[s][1])
        nesting = parents(where)
    sections = [(s, values[f"profile/{s}/time_ms"]) for s in names]
    for s in layout(sections, step_ms, nesting):
        at_us = start_us + s.start_ms * 1e3
        parts = {p: values.get(f"profile/{s.name}/{p}_ms") for p in (*PARTS, "enqueue")}
        if not any(v is not None for v in parts.values()):
            events.append(_event(s.name, rank, "sections", at_us, s.ms, depth=s.depth))
            continue
        events.append(_event(s.name, rank, "collectives", at_us, s.ms, depth=s.depth))
        offset_us = at_us
        for part in PARTS:  # the probe's wait, then the collective from aligned ranks
            if parts[part] is not None:
                events.append(
                    _event(f"{s.name}/{part}", rank, "collectives", offset_us, parts[part])
                )
                offset_us += parts[part] * 1e3
        if parts["enqueue"] is not None:  # host time inside the call: its own track
            transfer_us = offset_us - (parts["transfer"] or 0.0) * 1e3
            events.append(_event(f"{s.name}/enqueue", rank, "collective enqueue (host)",
                                 transfer_us, parts["enqueue"]))  # fmt: skip
    for event in events:
        late_rank = values.get(f"profile/{event['name']}/late_rank")
        if late_rank is not None:
            event["args"]["late_rank"] = int(late_rank)
    return events


def trace_events(store: RunStore) -> list[dict]:
    """Chrome trace events (``ph`` X and M) for every profiler window in the run."""
    _, rows = store.query(_PROFILE)
    windows: dict[tuple[int, int], tuple[float, dict[str, float]]] = {}
    for rank, step, name, value, time in rows:
        windows.setdefault((rank, step), (time, {}))[1][name] = value
    windows = {k: w for k, w in windows.items() if "profile/step/time_ms" in w[1]}
    # Time 0 is the first window's step start: a window ends at its report's time.
    starts = [t - v["profile/step/time_ms"] / 1e3 for t, v in windows.values()]
    origin = min(starts, default=0.0)
    events: list[dict] = []
    for (rank, step), (time, values) in sorted(windows.items()):
        events += _window_events(rank, step, (time - origin) * 1e6, values)
    for rank in sorted({rank for rank, _ in windows}):
        events.append({"name": "process_name", "ph": "M", "ts": 0, "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})  # fmt: skip
        for track, tid in TRACKS.items():
            events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": rank, "tid": tid,
                           "args": {"name": track}})  # fmt: skip
    return events


def write_trace(run_dir: str | os.PathLike, output: str | os.PathLike | None = None) -> RunPath:
    """Write the trace JSON; return its path. Raises ValueError without profiler records."""
    with RunStore(run_dir) as store:
        events = trace_events(store)
    if not any(e["ph"] == "X" for e in events):
        raise ValueError(
            f"{run_dir} has no profiler records: train with a Profiler "
            "(syncless demo --profile events) to trace"
        )
    path = run_path(output) if output else run_path(run_dir) / "trace.json"
    doc = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": str(run_dir),
            "note": "one step per report window per rank: durations are the window's means "
            "per step; positions within a step are reconstructed from the recorded nesting",
        },
    }
    write_whole(path, json.dumps(doc).encode())
    return path


def run(args: argparse.Namespace) -> int:
    """The ``trace`` command: 0 written, 1 no profiler records (usage errors raise)."""
    with warnings_on_stderr():
        try:
            path = write_trace(args.run_dir, getattr(args, "output", None))
        except ValueError as e:
            print(f"syncless: error: {e}", file=sys.stderr)
            return 1
    print(f"wrote {path}: open it in https://ui.perfetto.dev")
    return 0
