"""``syncless check RUN_DIR``: is every shard readable, and is every step there?

Rollups (syncless.run.rollups) are checked too: each footer, and that each width of a
rollup sums up as many records as its shard holds. A rollup that fails is a problem
(the report reads its shard instead, but ``syncless compact`` would not write it again
until it is deleted); a stray one (its shard covered or gone) is a note.

:func:`check` returns a :class:`RunHealth`; ``print_check`` renders it; ``run`` is the
command (exit status 0 healthy, 1 unhealthy, 2 usage error).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, NamedTuple, TextIO

from rich import box
from rich.console import Console
from rich.table import Table

from syncless.run.query_cli import to_stdout
from syncless.run.storage import list_files
from syncless.run.store import TABLES, RunStore, Shard

# Per rank: the stride is the most common distance between its consecutive steps
# (ties: the shorter). A gap is a longer distance: the stride's steps inside it are missing.
_STEPS = """
WITH s AS (SELECT DISTINCT rank, step FROM metrics),
d AS (SELECT rank, step, step - lag(step) OVER (PARTITION BY rank ORDER BY step) AS diff FROM s),
h AS (SELECT rank, diff, count(*) AS n FROM d WHERE diff IS NOT NULL GROUP BY rank, diff),
strides AS (
    SELECT rank, diff AS stride FROM (
        SELECT rank, diff, row_number() OVER (PARTITION BY rank ORDER BY n DESC, diff) AS i
        FROM h)
    WHERE i = 1)
"""
_RANKS = """
SELECT rank, count(*), min(step), max(step), count(DISTINCT step), any_value(stride)
FROM metrics LEFT JOIN strides USING (rank) GROUP BY rank ORDER BY rank
"""
_GAPS = """
SELECT rank, step - diff, step, stride FROM d JOIN strides USING (rank)
WHERE diff > stride ORDER BY rank, step
"""
_CAPTURE_EXTENTS = 'SELECT file, max("offset" + nbytes) FROM captures GROUP BY file ORDER BY file'
_ROLLUP_COUNTS = "SELECT file, width, sum(records) FROM metrics_rollups GROUP BY ALL ORDER BY ALL"


class Gap(NamedTuple):
    """Steps missing on a rank: ``first``, ``first + stride``, ..., ``last``."""

    first: int
    last: int
    count: int


@dataclass
class RankHealth:
    """One rank's step records."""

    rank: int
    records: int
    first_step: int
    last_step: int
    steps: int  # distinct steps with a record
    stride: int  # the usual distance between its steps (1: every step)
    gaps: list[Gap] = field(default_factory=list)

    @property
    def missing_steps(self) -> int:
        return sum(g.count for g in self.gaps)


@dataclass
class RunHealth:
    """What ``syncless check`` found in a run directory."""

    path: str
    world_size: int | None
    shards: list[Shard]
    ranks: list[RankHealth]
    capture_errors: list[str]  # capture data files shorter than their index says
    temp_files: list[str]  # left by a writer killed mid-shard; readers ignore them
    rollups: int = 0  # visible shards with a rollup that reads
    rollup_errors: list[str] = field(default_factory=list)  # unreadable or miscounting
    stray_rollups: list[str] = field(default_factory=list)  # shard covered or gone: ignored

    @property
    def unreadable(self) -> list[Shard]:
        return [s for s in self.shards if s.error is not None]

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks of ``world_size`` without a record (none while the run has no records)."""
        if not self.ranks or self.world_size is None:
            return []
        seen = {r.rank for r in self.ranks}
        return [r for r in range(self.world_size) if r not in seen]

    @property
    def problems(self) -> list[str]:
        problems = [f"unreadable shard {s.path}: {s.error}" for s in self.unreadable]
        problems += [f"rank {r} of {self.world_size} has no records" for r in self.missing_ranks]
        problems += [
            f"rank {r.rank} is missing {r.missing_steps} step(s): {_gaps_text(r.gaps)}"
            for r in self.ranks
            if r.gaps
        ]
        return problems + self.capture_errors + self.rollup_errors

    @property
    def healthy(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "healthy": self.healthy,
            "problems": self.problems,
            "world_size": self.world_size,
            "shards": [{**s._asdict(), "path": str(s.path)} for s in self.shards],
            "ranks": [
                {
                    **r.__dict__,
                    "missing_steps": r.missing_steps,
                    "gaps": [g._asdict() for g in r.gaps],
                }
                for r in self.ranks
            ],
            "capture_errors": self.capture_errors,
            "temp_files": self.temp_files,
            "rollups": self.rollups,
            "rollup_errors": self.rollup_errors,
            "stray_rollups": self.stray_rollups,
        }


def check(path: str | os.PathLike) -> RunHealth:
    """Read every shard of a run directory and report what is unreadable or missing."""
    with RunStore(path, warn=False) as store:
        store.verify()  # every footer, against what the names say: the manifest's check
        _, ranks = store.query(_STEPS + _RANKS)
        _, gaps = store.query(_STEPS + _GAPS)
        health = RunHealth(
            path=str(path),
            world_size=_world_size(store.info),
            shards=sorted(store.shards.values(), key=lambda s: (s.table, s.path)),
            ranks=[RankHealth(*r[:5], stride=r[5] or 1) for r in ranks],
            capture_errors=_capture_errors(store) if "captures" in store.tables else [],
            temp_files=sorted(
                str(store.path / folder / name)
                for folder, _ in TABLES.values()
                for name in fnmatch.filter(list_files(store.path / folder, "."), ".*.tmp")
            ),
            rollup_errors=_rollup_errors(store),
            stray_rollups=sorted(str(p) for p in store.stray_rollups),
        )
        health.rollups = len(store.rollups)
    by_rank = {r.rank: r for r in health.ranks}
    for rank, after, before, stride in gaps:
        count = (before - after - 1) // stride
        by_rank[rank].gaps.append(Gap(after + stride, after + count * stride, count))
    return health


def _rollup_errors(store: RunStore) -> list[str]:
    """Rollups that cannot be read, or that sum up another number of records than their
    shard holds (at any width)."""
    redo = "delete it and `syncless compact` writes it again"
    errors = [
        f"unreadable rollup {p}: {why} (its shard is read instead; {redo})"
        for p, why in sorted(store.bad_rollups.items(), key=lambda e: str(e[0]))
    ]
    shards = {store._real(r): (r, store.shards[s].rows) for s, r in store.rollups.items()}
    _, counts = store.query(_ROLLUP_COUNTS)
    for file, width, records in counts:
        rollup, rows = shards[file]
        if records != rows:
            errors.append(f"rollup {rollup} sums up {records} records at width {width}, its "
                          f"shard holds {rows} ({redo})")  # fmt: skip
    return errors


def _world_size(info: dict[str, Any]) -> int | None:
    """The most ranks the run had: a resumed run lists each start in ``segments``."""
    segments = info.get("segments")
    starts = [info, *(segments if isinstance(segments, list) else [])]
    sizes = [s.get("world_size") for s in starts if isinstance(s, dict)]
    return max((n for n in sizes if isinstance(n, int)), default=None)


def _capture_errors(store: RunStore) -> list[str]:
    """Capture data files that are missing or shorter than their index says."""
    errors = []
    _, extents = store.query(_CAPTURE_EXTENTS)
    for name, needed in extents:
        path = store.path / TABLES["captures"][0] / str(name)
        if PurePath(str(name)).name != name:
            errors.append(f"capture index names {name!r}, a file outside captures/")
            continue
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            errors.append(f"capture file {path} is missing")
            continue
        if size < needed:
            errors.append(
                f"capture file {path} is truncated: {size} bytes, its index needs {needed}"
            )
    return errors


def print_check(health: RunHealth, fmt: str = "table", out: TextIO | None = None) -> None:
    out = out or sys.stdout
    if fmt == "json":
        json.dump(health.to_dict(), out, indent=1)
        out.write("\n")
        return
    console = Console(file=out, width=max(100, Console().width))
    shards = Table("table", "readable", "rows", "unreadable", box=box.SIMPLE, title="shards")
    for table in TABLES:
        mine = [s for s in health.shards if s.table == table]
        if mine:
            bad = sum(s.error is not None for s in mine)
            shards.add_row(table, str(len(mine) - bad), str(sum(s.rows for s in mine)), str(bad))
    console.print(shards if shards.row_count else "no shards yet")
    if health.ranks:
        ranks = Table(
            *("rank", "records", "first step", "last step", "steps", "stride", "missing", "gaps"),
            box=box.SIMPLE,
            title="ranks",
        )
        for r in health.ranks:
            values = (r.rank, r.records, r.first_step, r.last_step, r.steps, r.stride)
            ranks.add_row(*map(str, values), str(r.missing_steps), _gaps_text(r.gaps) or "-")
        console.print(ranks)
    if health.temp_files:
        console.print(
            f"note: {len(health.temp_files)} temp file(s) of an interrupted write, ignored"
        )
    if health.stray_rollups:
        console.print(
            f"note: {len(health.stray_rollups)} rollup(s) of shards covered or gone, ignored "
            "(`syncless compact` deletes them)"
        )
    for problem in health.problems:
        console.print(f"problem: {problem}", markup=False, highlight=False, soft_wrap=True)
    verdict = "healthy" if health.healthy else f"unhealthy: {len(health.problems)} problem(s)"
    console.print(f"{health.path}: {verdict}", markup=False, highlight=False, soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    """The ``check`` command: 0 healthy, 1 unhealthy (usage errors raise)."""
    health = check(args.run_dir)
    to_stdout(lambda out: print_check(health, args.format, out))
    return 0 if health.healthy else 1


def _gaps_text(gaps: list[Gap], shown: int = 3) -> str:
    text = ", ".join(str(g.first) if g.count == 1 else f"{g.first}-{g.last}" for g in gaps[:shown])
    return text + (f" (+{len(gaps) - shown} more)" if len(gaps) > shown else "")
