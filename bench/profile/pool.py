"""Pool the per-period estimates of several profile_overhead runs of one commit.

One run of ``bench/profile/overhead.py`` resolves an overhead to about +-1.2 points
(95% interval of the median, 120 periods in 5 minutes on the H200): the demo step's
wall time jitters by several percent from step to step. A 1% target needs more periods
than one device call (10 minutes) holds, so runs write their estimates (``--dump``)
and this pools them: the same statistics over all periods, as if one long run.
Pooling is decided before the runs (all dumps of the commit, none left out).

    python -m bench.profile pool run0.json run1.json --label "2 copies side by side"
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.demo.train_step import overhead_summary
from bench.harness import append_result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dumps", nargs="+", help="profile_overhead --dump files")
    parser.add_argument("--label", default="", help="how the runs ran (appended to the line)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    runs = [json.loads(Path(path).read_text()) for path in args.dumps]
    presets = {run["preset"] for run in runs}
    if len(presets) != 1:
        raise SystemExit(f"runs of different presets {sorted(presets)}: pool one preset")
    modes = list(dict.fromkeys(m for run in runs for m in run["modes"]))
    parts = []
    for mode in modes:
        cells = [run["modes"][mode] for run in runs if mode in run["modes"]]
        wall = [e for cell in cells for e in cell["wall"]]
        cpu = [e for cell in cells for e in cell["cpu"]]
        own = [cell["self_ms"] for cell in cells if cell["self_ms"] is not None]
        own_text = f", profiler's own host time {statistics.fmean(own):.3f} ms/step" if own else ""
        parts.append(f"{mode} " + overhead_summary(wall, cpu, own_text))
        print(parts[-1])
    off = ", ".join(f"{run['off_ms']:.1f}" for run in runs)
    text = (
        f"pooled {len(runs)} runs of demo {presets.pop()} train step (tight loop), off "
        f"{off} ms/step, {runs[0]['sync']}{'; ' + args.label if args.label else ''}; "
        f"profiled step vs the 2 off steps before it, all periods of all runs: " + "; ".join(parts)
    )
    if not args.no_record:
        append_result("profile_overhead (pooled)", text)
