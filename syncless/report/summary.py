"""``syncless summary RUN_DIR``: a run's essentials as tables in the terminal.

:func:`read` aggregates the run in a few DuckDB queries into a :class:`RunTotals`;
:func:`print_summary` renders the sections the run has; ``run`` is the command.
Which layer is worst, and where step time goes, is read off the per-name totals.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TextIO

from rich import box
from rich.console import Console
from rich.table import Table

from syncless.report.nonfinite import FirstNonfinite, first_nonfinite
from syncless.run.query_cli import to_stdout, warnings_on_stderr
from syncless.run.store import RunStore

__all__ = ["RunTotals", "Stat", "mfu_text", "print_summary", "read", "run"]

log = logging.getLogger(__name__)

# One pass over every record: everything below is read off these per-name rows
# (a few hundred), not off the records. (file, row) is the order the records were
# written (the store's metrics_written view).
# The last value is the highest step's on the lowest rank that has it.
_TOTALS = """
SELECT name, count(*), avg(value), min(value), max(value), arg_max(value, step * 1048576 - rank),
       sum(value), arg_max(step, value), arg_min(step, value), min((file, row))
FROM metrics_written GROUP BY name
"""
_RUN = "SELECT count(*), count(DISTINCT rank), min(step), max(step), count(DISTINCT step), "
_RUN += "min(time), max(time) FROM metrics"
# The late rank's culprit needs each rank's section times: profile records only.
_PER_RANK = """
SELECT rank, name, avg(value) FROM metrics
WHERE name LIKE 'profile/%/time_ms' GROUP BY rank, name
"""
_CAPTURES = "SELECT count(*), sum(nbytes) FROM captures"

_LAYER = re.compile(r"monitors/(?P<layer>[^/]+)/(?P<metric>[^/]+)(?:/(?P<sub>[^/]+))?$")
_NOT_LAYERS = {"global", "self", "step"}
# (metric, label, worst is the highest?)
_WORST = [
    ("attn_qk_logit_max", "attention logit max", True),
    ("attn_entropy_nats", "attention entropy (nats)", False),
    ("act_absmax", "activation max |x|", True),
    ("grad_norm", "grad norm", True),
    ("update_ratio", "update / param ratio", True),
    ("moe_imbalance", "MoE imbalance (max/mean load)", True),
]
_PARTS = ("rendezvous", "enqueue", "transfer")
_CONFIG_KEYS = ("n_layers", "d_model", "n_heads", "n_experts", "top_k", "seq_len",
                "batch_size", "lr", "device", "dtype")  # fmt: skip


class Stat(NamedTuple):
    """One metric over the whole run, all ranks."""

    count: int
    mean: float
    min: float
    max: float
    last: float  # the value at the highest step
    total: float
    max_step: int  # the step of the max
    min_step: int  # the step of the min
    order: int  # first row written: records keep the profiler's section order


@dataclass
class RunTotals:
    """What ``syncless summary`` reads from a run: per-name totals and a few extras."""

    path: str
    info: dict[str, Any]
    records: int
    ranks: int
    first_step: int | None
    last_step: int | None
    steps: int
    seconds: float | None
    stats: dict[str, Stat]
    per_rank: dict[int, dict[str, float]] = field(default_factory=dict)
    captures: tuple[int, int] | None = None  # index rows, bytes
    nonfinite: FirstNonfinite | None = None  # None: the run recorded no NaN/Inf
    skipped: list[str] = field(default_factory=list)  # unreadable shards (the store warns)
    warnings: list[str] = field(default_factory=list)

    def find(self, *suffixes: str) -> tuple[str, Stat] | None:
        """The first metric named ``*/<suffix>`` for the first suffix any metric has."""
        for suffix in suffixes:
            for name in sorted(self.stats):
                if name == suffix or name.endswith("/" + suffix):
                    return name, self.stats[name]
        return None

    @property
    def step_ms(self) -> float | None:
        found = self.find("step/step_ms", "profile/step/time_ms")
        return found[1].mean if found else None


def read(path: str | os.PathLike) -> RunTotals:
    """Aggregate a run directory; unreadable shards are skipped with a warning."""
    with RunStore(path) as store:
        _, rows = store.query(_TOTALS)
        # The first (file, row) of each name, as its rank among them.
        order = {first: i for i, first in enumerate(sorted({r[9] for r in rows}))}
        stats = {
            r[0]: Stat(int(r[1]), *map(float, r[2:7]), int(r[7]), int(r[8]), order[r[9]])
            for r in rows
        }
        (records, ranks, first, last, steps, t0, t1) = store.query(_RUN)[1][0]
        totals = RunTotals(
            path=str(path),
            info=store.info,
            records=records,
            ranks=ranks,
            first_step=first,
            last_step=last,
            steps=steps,
            seconds=None if t0 is None else t1 - t0,
            stats=stats,
        )
        for rank, name, mean in store.query(_PER_RANK)[1]:
            totals.per_rank.setdefault(rank, {})[name] = mean
        if "captures" in store.tables:
            count, nbytes = store.query(_CAPTURES)[1][0]
            totals.captures = (count, int(nbytes or 0))
        totals.nonfinite = first_nonfinite(store)
        totals.skipped = [str(s.path) for s in store.unreadable]
    world = totals.info.get("world_size")
    if isinstance(world, int) and records and ranks < world:
        # A killed rank leaves no shard: say so, the tables are the other ranks only.
        totals.warnings.append(f"records from {ranks} of {world} ranks: the run is partial")
    return totals


def _num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    if value == int(value) and abs(value) < 1e12:
        return str(int(value))
    return f"{value:.{digits}g}"


def _table(title: str, *columns: str, header: bool = True) -> Table:
    # min_width: a title wider than its columns would wrap.
    return Table(*columns, box=box.SIMPLE, title=title, title_justify="left",
                 min_width=len(title) + 2, show_header=header)  # fmt: skip


def _run_table(t: RunTotals) -> Table:
    table = _table("run", "", "", header=False)
    info, env = t.info, t.info.get("env") or {}
    config = info.get("config") or {}
    table.add_row("name", str(info.get("name", "-")))
    table.add_row("directory", t.path)
    table.add_row("world size", f"{info.get('world_size', '-')} ({t.ranks} with records)")
    if t.first_step is not None:
        table.add_row("steps", f"{t.first_step}..{t.last_step} ({t.steps} with records)")
    if t.seconds is not None:
        table.add_row("duration", f"{t.seconds:.1f} s (first to last record)")
    table.add_row("records", str(t.records))
    tokens = t.find("step/tokens_per_s")
    if tokens:
        table.add_row("throughput", f"{tokens[1].mean:,.0f} tokens/s (mean)")
    mfu = t.find("step/mfu_frac")
    utilisation = mfu_text(mfu[1].mean if mfu else None, config)
    if utilisation:
        table.add_row("MFU", utilisation)
    keys = [k for k in _CONFIG_KEYS if k in config] or list(config)[:8]
    if keys:
        table.add_row("config", ", ".join(f"{k}={config[k]}" for k in keys))
    versions = [f"{k} {env[k]}" for k in ("syncless", "torch", "python", "cuda") if env.get(k)]
    if versions:
        table.add_row("versions", ", ".join(versions))
    return table


def mfu_text(mean: float | None, config: dict[str, Any], source: str = "") -> str | None:
    """A run's mean MFU and the peak it is taken against, or why it has none.

    ``config``: the run's ``flops_per_token``, ``peak_flops`` and ``peak_flops_about``,
    as the demo records them; ``source``: the metric the mean is of. None for a run
    that records none of them.
    """
    per_token = config.get("flops_per_token")
    work = ""
    if per_token:
        big = per_token >= 1e9
        work = f"; {per_token / (1e9 if big else 1e6):.4g} {'G' if big else 'M'}FLOP per token"
    peak, about = config.get("peak_flops"), config.get("peak_flops_about")
    if mean is not None and peak:
        what = f"mean, {source}" if source else "mean"
        return f"{mean:.1%} ({what}) of {peak / 1e12:,.0f} TFLOP/s per device ({about}){work}"
    if about and per_token:
        return f"not measured: {about}{work}"
    return None


def _training_table(t: RunTotals) -> Table | None:
    table = _table("training", "metric", "last", "mean", "min", "max")
    for suffix in ("step/loss", "step/lr", "step/step_ms", "step/grad_norm"):
        found = t.find(suffix)
        if found:
            name, s = found
            table.add_row(name, *(_num(v) for v in (s.last, s.mean, s.min, s.max)))
    return table if table.row_count else None


def _layer_stats(t: RunTotals) -> dict[str, dict[str, dict[str | None, Stat]]]:
    """metric -> layer -> sub-name (head, expert; None for the layer) -> Stat."""
    out: dict[str, dict[str, dict[str | None, Stat]]] = {}
    for name, stat in t.stats.items():
        m = _LAYER.match(name)
        if m and m["layer"] not in _NOT_LAYERS:
            out.setdefault(m["metric"], {}).setdefault(m["layer"], {})[m["sub"]] = stat
    return out


def worst_layers(t: RunTotals) -> list[tuple[str, str, str, float, int]]:
    """(what, layer, head or expert, value, step) for each monitored metric's worst layer."""
    layers = _layer_stats(t)
    out = []
    for metric, label, highest in _WORST:
        by_layer = {k: v[None] for k, v in layers.get(metric, {}).items() if None in v}
        if not by_layer:
            continue
        pick = max if highest else min

        def value(s: Stat, highest: bool = highest) -> float:
            return s.max if highest else s.min

        layer = pick(sorted(by_layer), key=lambda k: value(by_layer[k]))
        stat = by_layer[layer]
        subs = {k: s for k, s in layers[metric][layer].items() if k is not None}
        sub = pick(sorted(subs), key=lambda k: value(subs[k])) if subs else "-"
        if metric == "moe_imbalance":  # the overloaded expert: most tokens routed to it
            experts = {k: s for k, s in layers.get("moe_tokens_count", {}).get(layer, {}).items()
                       if k is not None}  # fmt: skip
            sub = max(sorted(experts), key=lambda k: experts[k].total) if experts else "-"
        step = stat.max_step if highest else stat.min_step
        out.append((label, layer, sub, value(stat), step))
    for layer, subs in sorted(layers.get("nonfinite_count", {}).items()):
        if None in subs and subs[None].total > 0:
            out.append(
                ("nonfinite values (total)", layer, "-", subs[None].total, subs[None].max_step)
            )
    return out


def _layers_table(t: RunTotals) -> Table | None:
    table = _table("worst layers", "what", "layer", "head / expert", "value", "at step")
    for label, layer, sub, value, step in worst_layers(t):
        table.add_row(label, layer, sub, _num(value), str(step))
    return table if table.row_count else None


def _collectives(t: RunTotals) -> list[str]:
    names = {n.rsplit("/", 2)[1] for n in t.stats if n.startswith("profile/")
             and n.rsplit("/", 1)[1] in {f"{p}_ms" for p in _PARTS}}  # fmt: skip
    whole = {c: t.stats.get(f"profile/{c}/time_ms") for c in names}
    return sorted(names, key=lambda c: (whole[c].order if whole[c] else 0, c))


def culprit(t: RunTotals, late_rank: int) -> tuple[str, float] | None:
    """The plain section furthest above the other ranks' median on the late rank.

    Recomputed here as the profiler does (the records keep the late rank, not the
    culprit), over the run's means rather than one report window.
    """
    mine, others = t.per_rank.get(late_rank), [v for r, v in t.per_rank.items() if r != late_rank]
    if not mine or not others:
        return None
    skip = {"step", "self", *_collectives(t)}
    excess = {}
    for name, ms in mine.items():
        section = name.split("/")[1]
        if section not in skip:
            excess[section] = ms - statistics.median(o.get(name, 0.0) for o in others)
    best = max(sorted(excess), key=excess.__getitem__, default=None)
    return (best, excess[best]) if best is not None and excess[best] > 0 else None


def _section_place(t: RunTotals, name: str) -> tuple[float, int]:
    """Depth-first, as the profiler recorded it (``order_count``); runs from before the
    profiler wrote its nesting fall back to the order their records were stored in."""
    order = t.stats.get(name.replace("/time_ms", "/order_count"))
    return (order.last if order else float("inf"), t.stats[name].order)


def _time_tables(t: RunTotals) -> list[Table]:
    step = t.stats.get("profile/step/time_ms")
    if step is None:
        return []
    collectives = _collectives(t)
    sections = _table(f"where step time goes (profiler, {step.mean:.4g} ms/step)",
                      "section", "ms/step", "% of step")  # fmt: skip
    names = [n for n in t.stats if n.startswith("profile/") and n.endswith("/time_ms")]
    for name in sorted(names, key=lambda n: _section_place(t, n)):
        section = name.split("/")[1]
        if section not in ("step", "self"):
            ms = t.stats[name].mean
            share = 100 * ms / step.mean if step.mean else 0.0
            depth = t.stats.get(f"profile/{section}/depth_count")
            indent = "  " * round(depth.last) if depth else ""  # nested under its parent
            sections.add_row(indent + section, _num(ms), f"{share:.1f}")
    tables = [sections]
    if collectives:
        split = _table("collectives", "collective", "ms/step", *(f"{p} ms" for p in _PARTS),
                       "late rank", "culprit (excess ms/step)")  # fmt: skip
        for c in collectives:
            parts = [t.stats.get(f"profile/{c}/{p}_ms") for p in _PARTS]
            whole = t.stats.get(f"profile/{c}/time_ms")
            late = t.stats.get(f"profile/{c}/late_rank")
            blame = culprit(t, int(late.last)) if late else None
            split.add_row(
                c, _num(whole.mean if whole else None), *(_num(p.mean if p else None) for p in parts),
                _num(late.last) if late else "-",
                f"{blame[0]} (+{blame[1]:.3g})" if blame else "-",
            )  # fmt: skip
        tables.append(split)
    return tables


def _dataplane_table(t: RunTotals) -> Table | None:
    ops = [n.split("/")[2] for n in t.stats
           if n.startswith("dataplane/step/") and n.endswith("/wall_ms") and n.count("/") == 3]  # fmt: skip
    if not ops:
        return None
    step_ms = t.step_ms
    table = _table("data plane (worst first)", "op", "ms/step", "% of step", "MB/step",
                   "calls/step", "errors")  # fmt: skip

    def mean(op: str, what: str) -> float | None:
        s = t.stats.get(f"dataplane/step/{op}/{what}")
        return s.mean if s else None

    for op in sorted(ops, key=lambda o: -(mean(o, "wall_ms") or 0.0)):
        wall = mean(op, "wall_ms") or 0.0
        share = f"{100 * wall / step_ms:.2f}" if step_ms else "-"
        errors = t.stats.get(f"dataplane/step/{op}/errors_count")
        table.add_row(op, _num(wall), share, _num(mean(op, "mb")), _num(mean(op, "calls_count")),
                      _num(errors.total if errors else None))  # fmt: skip
    return table


def _captures_table(t: RunTotals) -> Table | None:
    table = _table("captures", "", "count", "bytes")
    if t.captures is not None:
        table.add_row("in the index (captures/)", str(t.captures[0]), str(t.captures[1]))
    for what in ("captured", "stored"):
        count, nbytes = (t.stats.get(f"capture/step/{what}_{u}") for u in ("count", "bytes"))
        if count or nbytes:  # counters are deltas per report: their sum is the run's
            table.add_row(what, _num(count.total if count else None),
                          _num(nbytes.total if nbytes else None))  # fmt: skip
    drops = re.compile(r"capture/step/dropped_(?P<reason>.+)_count$")
    for name in sorted(t.stats):
        m = drops.match(name)
        if m and t.stats[name].total > 0:
            nbytes = t.stats.get(f"capture/step/dropped_{m['reason']}_bytes")
            table.add_row(f"dropped: {m['reason']}", _num(t.stats[name].total),
                          _num(nbytes.total if nbytes else None))  # fmt: skip
    return table if table.row_count else None


def _self_table(t: RunTotals) -> Table | None:
    names = sorted(n for n in t.stats if "/self/" in n)
    if not names:
        return None
    step_ms = t.step_ms
    title = "what syncless cost" + (f" (step {step_ms:.4g} ms)" if step_ms else "")
    table = _table(title, "metric", "mean", "max", "% of step")
    for name in names:
        s = t.stats[name]
        timed = name.endswith("_ms") and not name.endswith("/step_ms") and step_ms
        share = f"{100 * s.mean / step_ms:.2f}" if timed else "-"
        table.add_row(name, _num(s.mean), _num(s.max), share)
    return table


def print_summary(totals: RunTotals, out: TextIO | None = None) -> None:
    """Print the sections the run has, in a fixed order; a NaN/Inf the run saw comes first."""
    console = Console(file=out or sys.stdout, width=max(100, Console().width))
    if totals.nonfinite:
        for line in totals.nonfinite.lines():
            console.print(line, style="bold red", markup=False, highlight=False)
        console.print()
    console.print(_run_table(totals))
    if not totals.records:
        console.print("no records yet")
    tables = [_training_table(totals), _layers_table(totals), *_time_tables(totals),
              _dataplane_table(totals), _captures_table(totals), _self_table(totals)]  # fmt: skip
    for table in tables:
        if table is not None:
            console.print(table)


def run(args: argparse.Namespace) -> int:
    """The ``summary`` command: 0, or a usage error (raised) for a path that is not a run."""
    with warnings_on_stderr():
        totals = read(args.run_dir)
        for warning in totals.warnings:
            log.warning("%s", warning)
    to_stdout(lambda out: print_summary(totals, out))
    return 0
