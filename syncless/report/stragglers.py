"""``syncless stragglers RUN``: the straggler verdicts a run recorded, read back.

The profiler stores each open verdict on the rank it names, at every report:
``profile/<section>/straggler_verdict_first_step``, ``_last_step``, ``_score`` and, for
``gpu_clock``, ``_clock_mhz`` (syncless.profile.report.straggler_values). One DuckDB
scan of those records groups them into episodes (rank, section, first step): the
latest report of an episode gives its last step and score. Imports DuckDB only: no torch,
numpy or pyarrow (the command starts in a fresh process; docs/stragglers.md).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import NamedTuple, TextIO

from syncless.run.placement import Placement, read_placement
from syncless.run.query_cli import to_stdout, warnings_on_stderr
from syncless.run.store import RunStore

__all__ = ["StoredVerdict", "placed", "print_verdicts", "read", "read_store", "run"]

_PATTERN = r"^profile/(.+)/straggler_verdict_(first_step|last_step|score|clock_mhz)$"
# Per (rank, step, section): an open verdict's first and last step, score and clock;
# then per episode (rank, section, first step), its latest report. One cheap filter
# (contains) finds the few verdict records among all; the regexp runs on those only.
_VERDICTS = f"""
WITH parts AS (
  SELECT rank, step, regexp_extract(name, '{_PATTERN}', 1) AS section,
         regexp_extract(name, '{_PATTERN}', 2) AS part, value
  FROM metrics
  WHERE contains(name, '/straggler_verdict_') AND regexp_matches(name, '{_PATTERN}')
), reports AS (
  SELECT rank, step, section,
         max(value) FILTER (WHERE part = 'first_step') AS first_step,
         max(value) FILTER (WHERE part = 'last_step') AS last_step,
         max(value) FILTER (WHERE part = 'score') AS score,
         max(value) FILTER (WHERE part = 'clock_mhz') AS clock
  FROM parts GROUP BY rank, step, section
)
SELECT rank, section, arg_max(score, step), CAST(first_step AS BIGINT),
       CAST(arg_max(last_step, step) AS BIGINT), arg_max(clock, step)
FROM reports WHERE first_step IS NOT NULL
GROUP BY rank, section, first_step
ORDER BY 3, rank, section, 4
"""


class StoredVerdict(NamedTuple):
    """One episode of a rank slow in a section, as the run stored it."""

    rank: int
    section: str
    score: float  # at the episode's latest report: fleet median / own
    first_step: int
    last_step: int  # the last step of its latest slow report
    clock_mhz: float | None = None  # gpu_clock: the rank's minimum SM clock then
    place: Placement | None = None  # where the rank ran (syncless.run.placement)

    def to_json(self) -> dict:
        out = {"rank": self.rank, "section": self.section, "score": self.score,
               "first_step": self.first_step, "last_step": self.last_step}  # fmt: skip
        if self.clock_mhz is not None:
            out["clock_mhz"] = self.clock_mhz
        if self.place is not None:
            out |= {"host": self.place.host, "local_rank": self.place.local_rank,
                    "gpu": self.place.gpu}  # fmt: skip
        return out


def read(path: str | os.PathLike) -> list[StoredVerdict]:
    """Every verdict episode of the run at ``path``, lowest score first, with where
    each named rank ran (read for those ranks only: a file each)."""
    with RunStore(path) as store:
        return placed(read_store(store), path)


def placed(verdicts: list[StoredVerdict], path: str | os.PathLike) -> list[StoredVerdict]:
    """``verdicts`` with where each named rank ran (a file read per named rank)."""
    places = {rank: read_placement(path, rank) for rank in {v.rank for v in verdicts}}
    return [v._replace(place=places[v.rank]) for v in verdicts]


def read_store(store: RunStore) -> list[StoredVerdict]:
    """:func:`read` on an open run."""
    return [
        StoredVerdict(int(rank), section, float("nan") if score is None else float(score),
                      int(first), int(last), None if clock is None else float(clock))
        for rank, section, score, first, last, clock in store.sql(_VERDICTS).fetchall()
    ]  # fmt: skip


def print_verdicts(verdicts: list[StoredVerdict], out: TextIO, run_dir: str = "") -> None:
    """A line per verdict: rank, section, score, first and last step."""
    where = f" in {run_dir}" if run_dir else ""
    if not verdicts:
        out.write(f"no stragglers{where}: no rank was named slow in any section\n")
        return
    out.write(f"{len(verdicts)} straggler verdict(s){where}, slowest first ")
    out.write("(score = fleet median / own time: 0.5 is twice as slow)\n")
    out.write(f"{'rank':>6}  {'section':<24} {'score':>6}  {'first step':>10}  "
              f"{'last step':>10}  where\n")  # fmt: skip
    for v in verdicts:
        where = v.place.describe() if v.place is not None else "-"
        note = f"  SM clock {v.clock_mhz:.0f} MHz" if v.clock_mhz is not None else ""
        out.write(f"{v.rank:>6}  {v.section:<24} {v.score:>6.2f}  {v.first_step:>10}  "
                  f"{v.last_step:>10}  {where}{note}\n")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """The ``stragglers`` command: 0, or a usage error (raised) for a path that is not
    a run."""
    with warnings_on_stderr():
        verdicts = read(args.run_dir)
    if args.format == "json":

        def write(out: TextIO) -> None:
            json.dump([v.to_json() for v in verdicts], out, indent=1)
            out.write("\n")

        to_stdout(write)
    else:
        to_stdout(lambda out: print_verdicts(verdicts, out, args.run_dir))
    return 0
