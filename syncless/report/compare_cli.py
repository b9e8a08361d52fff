"""``syncless compare BASE RUN [RUN ...]``: a :class:`~syncless.report.compare.Comparison`
as tables in the terminal, or as JSON.

One row per run in every table, the baseline first, so forty ablations read down a
column: the config keys that differ, the loss at matching steps and where it left the
baseline's, speed, the first NaN/Inf or spike, each monitor's worst layer and the layer
that moved first; then the profile sections that changed most.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, TextIO

from rich import box
from rich.console import Console
from rich.table import Table

from syncless.report.compare import Comparison, RunSide, compare
from syncless.run.console import print_wide
from syncless.run.query_cli import to_stdout, warnings_on_stderr

__all__ = ["print_comparison", "run"]

# Config keys shown as columns; the rest are counted in a note.
CONFIG_COLUMNS = 8
# Runs side by side in the worst-layers table; more runs make more tables.
RUN_COLUMNS = 5


def run(args: argparse.Namespace) -> int:
    """The ``compare`` command: 0, or a usage error (raised) for bad input."""
    with warnings_on_stderr():
        comparison = compare(args.runs)
    if args.format == "json":
        to_stdout(lambda out: _write_json(comparison, out))
    else:
        to_stdout(lambda out: print_comparison(comparison, out))
    return 0


def _write_json(comparison: Comparison, out: TextIO) -> None:
    json.dump(comparison.to_json(), out, indent=1)
    out.write("\n")


def print_comparison(comparison: Comparison, out: TextIO | None = None) -> None:
    """Print every table the runs have data for."""
    console = Console(file=out or sys.stdout, width=max(100, Console().width))
    base = comparison.runs[0]
    console.print(
        f"{len(comparison.runs)} runs against the baseline {base.id}"
        + (f" ({base.name})" if base.name != base.id else ""),
        markup=False,
        highlight=False,
    )
    for table in (
        _config(comparison),
        _loss(comparison),
        _speed(comparison),
        _alarms(comparison),
        _moved(comparison),
        *_layers(comparison),
        _sections(comparison),
    ):
        if table is not None:
            print_wide(console, table)


def _table(title: str, *columns: str) -> Table:
    return Table(*columns, box=box.SIMPLE, title=title, title_justify="left",
                 min_width=len(title) + 2)  # fmt: skip


def _label(side: RunSide, i: int) -> str:
    return f"{side.id} (base)" if i == 0 else side.id


def _config(c: Comparison) -> Table:
    shown = c.config.differences[:CONFIG_COLUMNS]
    title = f"config: {len(c.config.differences)} key(s) differ, {c.config.same} the same"
    if len(c.config.differences) > len(shown):
        title += f" (first {len(shown)} shown; --format json has all)"
    table = _table(title, "run", *(d.key for d in shown))
    for i, side in enumerate(c.runs):
        table.add_row(_label(side, i), *(_value(d.values[i]) for d in shown))
    return table


def _loss(c: Comparison) -> Table | None:
    if not c.checkpoints:
        return None
    every = f", every {c.loss_bucket} steps averaged" if c.loss_bucket > 1 else ""
    table = _table(
        f"loss ({c.runs[0].loss}, mean over ranks{every}) at matching steps",
        "run", *(f"step {s}" for s in c.checkpoints), "last - base", "first differs",
        "beyond noise",
    )  # fmt: skip
    for i, side in enumerate(c.runs):
        d = side.divergence
        tail = ["", "", ""]
        if d is not None:
            tail = [_num(d.last_difference, signed=True), _step(d.first_different),
                    _step(d.first_beyond_noise)]  # fmt: skip
        table.add_row(_label(side, i), *(_num(v) for v in side.loss_at), *tail)
    return table


def _speed(c: Comparison) -> Table | None:
    if not any(side.speed for side in c.runs):
        return None
    table = _table("speed (median over steps and ranks)", "run", "tokens/s", "vs base",
                   "step ms", "vs base", "MFU")  # fmt: skip
    base = c.runs[0].speed
    for i, side in enumerate(c.runs):
        cells = [_label(side, i)]
        for what in ("tokens_per_s", "step_ms"):
            mine = side.speed.get(what)
            cells.append(_num(mine.median) if mine else "-")
            theirs = base.get(what)
            cells.append(_percent(mine.median, theirs.median) if mine and theirs and i else "")
        mfu = side.speed.get("mfu_frac")
        cells.append(f"{mfu.median:.1%}" if mfu else "-")
        table.add_row(*cells)
    return table


def _alarms(c: Comparison) -> Table | None:
    if not any(side.alarms.first() or side.alarms.moved_layer is not None for side in c.runs):
        return None
    table = _table("first NaN/Inf or spike", "run", "first", "NaN/Inf output",
                   "loss spike", "grad norm spike", "spikes (loss, grad norm)",
                   "moved first (monitors)")  # fmt: skip
    for i, side in enumerate(c.runs):
        a = side.alarms
        first = a.first()
        nan = "-" if a.output_step is None else f"step {a.output_step}, layer {a.output_layer}"
        moved = "-" if a.moved_layer is None else f"layer {a.moved_layer}, step {a.moved_step}"
        table.add_row(
            _label(side, i),
            "-" if first is None else f"step {first[0]}: {first[1]}",
            nan,
            _step(a.loss_spike_step),
            _step(a.grad_norm_spike_step),
            f"{_count(a.loss_spikes)}, {_count(a.grad_norm_spikes)}",
            moved,
        )
    return table


def _moved(c: Comparison) -> Table | None:
    if all(side.moved is None for side in c.runs[1:]) and not any(side.worst for side in c.runs):
        return None
    every = f" (buckets of {c.bucket} steps)" if c.bucket > 1 else ""
    table = _table(f"the layer that left the baseline first, beyond noise{every}",
                   "run", "step", "layer", "monitor")  # fmt: skip
    for side in c.runs[1:]:
        m = side.moved
        table.add_row(
            side.id, *(("-", "-", "-") if m is None else (str(m.step), str(m.layer), m.metric))
        )
    return table


def _layers(c: Comparison) -> list[Table]:
    """Each monitor's worst layer (layer: value @ step), a column per run: the baseline
    and up to RUN_COLUMNS - 1 others a table."""
    metrics = sorted({m for side in c.runs for m in side.worst})
    if not metrics:
        return []
    base, others = c.runs[0], c.runs[1:]
    tables = []
    for start in range(0, max(1, len(others)), RUN_COLUMNS - 1):
        group = [base, *others[start : start + RUN_COLUMNS - 1]]
        table = _table("worst layer by each monitor (layer: value @ step)", "monitor",
                       *(_label(side, c.runs.index(side)) for side in group))  # fmt: skip
        for metric in metrics:
            cells = []
            for side in group:
                w = side.worst.get(metric)
                cells.append("-" if w is None else f"{w.layer}: {_num(w.value)} @ {w.step}")
            table.add_row(metric, *cells)
        tables.append(table)
    return tables


def _sections(c: Comparison) -> Table | None:
    if not c.sections:
        return None
    table = _table("profile sections that changed most (ms per step, mean over ranks)",
                   "section", "run", "base", "run", "change", "vs base")  # fmt: skip
    for change in c.sections:
        table.add_row(
            change.section,
            change.run,
            _num(change.base_ms),
            _num(change.ms),
            _num(change.change_ms, signed=True),
            _percent(change.ms, change.base_ms) if change.ms and change.base_ms else "",
        )
    return table


def _num(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return f"{value:+.4g}" if signed else f"{value:.4g}"


def _percent(value: float, base: float) -> str:
    return f"{100 * (value - base) / base:+.1f}%" if base else ""


def _step(step: int | None) -> str:
    return "-" if step is None else str(step)


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def _value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
