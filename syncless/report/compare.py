"""Runs against a baseline: what ``syncless compare`` prints, read in a few DuckDB queries.

:func:`compare` opens the runs as one store (``syncless.run.open_runs``) and reads, for
every run at once: per-name totals (one scan: the worst layers and the profile
sections), the loss per step, the medians of the speed metrics, the alarms' records,
and each per-layer monitor in step buckets (the layer that moved first). The first run
is the baseline; :class:`Comparison` holds the answers, ``report/compare_cli.py`` prints
them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np

from syncless.errors import UsageError
from syncless.report.bands import Grid, floats, read_series
from syncless.report.config_diff import ConfigDiff, diff_configs
from syncless.report.data import LAYER_NAME
from syncless.report.divergence import Divergence, divergence, matching
from syncless.report.nonfinite import (
    GRAD_LAYER,
    GRAD_NORM_SPIKE,
    GRAD_NORM_STEP,
    LOSS_SPIKE,
    LOSS_STEP,
    MOVED_LAYER,
    MOVED_STEP,
    OUTPUT_LAYER,
    OUTPUT_STEP,
)
from syncless.report.sections_layers import LOWEST_IS_WORST
from syncless.report.sections_run import SYNCLESS_AREAS
from syncless.run.runset import RunEntry
from syncless.run.store import RunStore, sql_string

__all__ = ["Alarms", "Comparison", "RunSide", "SectionChange", "Speed", "WorstLayer", "check_shared",
           "compare"]  # fmt: skip

# The spike alarms' counts (monitors, issue #46; older runs have none): spikes per readout.
LOSS_SPIKES = "monitors/step/loss_spike_count"
GRAD_NORM_SPIKES = "monitors/step/grad_norm_spike_count"

#: The most loss points per run read for the divergence test: past it, steps are
#: averaged in buckets (a 1,000,000-step run is read at every 10th step).
LOSS_POINTS = 100_000
#: Loss columns printed: matching steps spread evenly over the runs.
CHECKPOINTS = 6
#: Profile sections listed: the largest changes.
SECTIONS = 10
PROFILE = re.compile(r"profile/([^/]+)/time_ms")
PROFILER_ROWS = ("step", "self", "calibration")  # not sections of the step


class Speed(NamedTuple):
    """A speed metric of one run: its name, median and mean over steps and ranks."""

    name: str
    median: float
    mean: float


class WorstLayer(NamedTuple):
    """A per-layer monitor's worst layer in one run: the value and where it was."""

    layer: int
    value: float
    step: int


class LayerMove(NamedTuple):
    """The first per-layer monitor whose bucket means left the baseline's, beyond noise."""

    step: int  # first step of the bucket
    layer: int
    metric: str


class SectionChange(NamedTuple):
    """A profile section's mean ms per step in a run against the baseline."""

    section: str
    run: str
    base_ms: float | None  # None: the baseline has no such section
    ms: float | None  # None: the run has none
    change_ms: float


@dataclass
class Alarms:
    """A run's first NaN/Inf and first spikes (None: none recorded)."""

    output_step: int | None = None  # first step a layer output held a NaN/Inf
    output_layer: int | None = None
    loss_step: int | None = None  # first nonfinite loss
    grad_norm_step: int | None = None  # first nonfinite total gradient norm
    grad_step: int | None = None  # first nonfinite layer gradient norm
    grad_layer: int | None = None
    loss_spike_step: int | None = None
    grad_norm_spike_step: int | None = None
    loss_spikes: int | None = None  # spikes counted over the run
    grad_norm_spikes: int | None = None
    moved_step: int | None = None  # the layer that moved first, as the monitors named it
    moved_layer: int | None = None

    def first(self) -> tuple[int, str] | None:
        """The earliest of them: (step, what)."""
        found = [
            (self.output_step, f"NaN/Inf in layer {self.output_layer} output"),
            (self.loss_step, "NaN/Inf loss"),
            (self.grad_norm_step, "NaN/Inf gradient norm"),
            (self.grad_step, f"NaN/Inf gradient of layer {self.grad_layer}"),
            (self.loss_spike_step, "loss spike"),
            (self.grad_norm_spike_step, "gradient norm spike"),
        ]
        present = [(s, what) for s, what in found if s is not None]
        return min(present, key=lambda f: f[0]) if present else None


@dataclass
class RunSide:
    """One run as the comparison sees it."""

    id: str
    name: str
    path: str
    loss: str | None = None  # its loss metric
    divergence: Divergence | None = None  # its loss against the baseline's
    loss_at: list[float | None] = field(default_factory=list)  # at Comparison.checkpoints
    speed: dict[str, Speed] = field(default_factory=dict)  # tokens_per_s, step_ms, mfu_frac
    alarms: Alarms = field(default_factory=Alarms)
    worst: dict[str, WorstLayer] = field(default_factory=dict)  # monitor metric -> layer
    moved: LayerMove | None = None  # against the baseline
    sections: dict[str, float] = field(default_factory=dict)  # profile section -> ms/step


@dataclass
class Comparison:
    """Several runs against the first. ``runs[0]`` is the baseline."""

    runs: list[RunSide]
    config: ConfigDiff
    checkpoints: list[int]  # matching steps the loss is shown at
    sections: list[SectionChange]
    bucket: int  # steps per bucket of the per-layer monitors (the moved-first resolution)
    loss_bucket: int  # steps per loss point (1: every step)

    def to_json(self) -> dict[str, Any]:
        """Everything, as plain JSON values (NaN as None)."""
        return _plain(asdict(self))


def compare(paths: Sequence[str]) -> Comparison:
    """Compare the runs at ``paths`` (run directories or folders of runs) with the first."""
    with RunStore(list(paths)) as store:
        if len(store.runs) < 2:
            raise UsageError(
                f"compare needs two runs or more, found one ({store.runs[0].path}): pass the "
                "baseline first, then the runs to set against it (or a folder of runs)"
            )
        sides = [RunSide(r.id, str(r.info.get("name", r.id)), str(r.path)) for r in store.runs]
        totals = _totals(store)
        check_shared(store.runs, [set(totals.get(r.id, {})) for r in store.runs])
        for side in sides:
            mine = totals.get(side.id, {})
            side.worst = _worst_layers(mine)
            side.sections = {
                m.group(1): row[1]
                for name, row in mine.items()
                if (m := PROFILE.fullmatch(name)) and m.group(1) not in PROFILER_ROWS
            }
        checkpoints, loss_bucket = _loss(store, sides, totals)
        _speed(store, sides, totals)
        _alarms(store, sides)
        bucket = _moved(store, sides, totals)
        return Comparison(
            runs=sides,
            config=diff_configs(store.runs),
            checkpoints=checkpoints,
            sections=_section_changes(sides),
            bucket=bucket,
            loss_bucket=loss_bucket,
        )


# Per (run, name): count, mean, min, max, the step of each, sum. One scan of every run.
_TOTALS = """
SELECT run, name, count(*), avg(value), min(value), max(value), arg_min(step, value),
       arg_max(step, value), sum(value), min(step), max(step)
FROM metrics GROUP BY run, name
"""


def _totals(store: RunStore) -> dict[str, dict[str, tuple]]:
    """run -> name -> (count, mean, min, max, step of min, step of max, sum, first step,
    last step)."""
    out: dict[str, dict[str, tuple]] = {}
    for run, name, *row in store.sql(_TOTALS).fetchall():
        out.setdefault(run, {})[name] = tuple(row)
    return out


def check_shared(runs: Sequence[RunEntry], names: Sequence[set[str]]) -> None:
    """Raise UsageError when the runs (each recording ``names``) have no metric in
    common: nothing could be compared. The message says what each run records."""
    if set.intersection(*names):
        return
    empty = [r.id for r, n in zip(runs, names, strict=True) if not n]
    if empty:
        raise UsageError(f"nothing to compare: no records in {', '.join(empty)}")
    areas = [sorted({n.split("/")[0] + "/..." for n in found}) for found in names]
    said = "; ".join(f"{r.id}: {', '.join(a[:4])}" for r, a in zip(runs, areas, strict=True))
    raise UsageError(f"the runs have no metric in common, nothing to compare ({said})")


def _user_metric(names: Sequence[str], suffix: str) -> str | None:
    """The first ``area/step/<suffix>`` outside syncless's own areas."""
    found = sorted(
        n for n in names if n.endswith(f"/step/{suffix}") and n.count("/") == 2
        and n.split("/")[0] not in SYNCLESS_AREAS
    )  # fmt: skip
    return found[0] if found else None


def _loss(
    store: RunStore, sides: list[RunSide], totals: dict[str, dict[str, tuple]]
) -> tuple[list[int], int]:
    """Each run's loss per step (mean over ranks), its divergence from the baseline's,
    and its values at checkpoints. Returns the checkpoints and the steps per point."""
    shared = set.intersection(*(set(totals.get(s.id, {})) for s in sides))
    common = _user_metric(sorted(shared), "loss")
    for side in sides:
        side.loss = common or _user_metric(list(totals.get(side.id, {})), "loss")
    with_loss = [s for s in sides if s.loss]
    if len(with_loss) < 2 or sides[0].loss is None:
        return [], 1
    first = min(totals[s.id][s.loss][7] for s in with_loss)
    last = max(totals[s.id][s.loss][8] for s in with_loss)
    grid = Grid.spanning(first, last, LOSS_POINTS)
    pairs = " OR ".join(
        f"(run = {sql_string(s.id)} AND name = {sql_string(s.loss)})" for s in with_loss
    )
    columns = store.sql(
        f"SELECT run, {grid.bucket()} AS s, avg(value) AS v FROM metrics WHERE {pairs} "
        "GROUP BY ALL ORDER BY run, s"
    ).fetchnumpy()
    curves = _split(columns["run"], np.asarray(columns["s"]), floats(columns["v"]))
    base = curves.get(sides[0].id)
    if base is None:
        return [], grid.size
    for side in sides[1:]:
        if side.id in curves:
            side.divergence = divergence(*matching(*base, *curves[side.id]))
    steps = base[0]
    for side in sides[1:]:
        if side.id in curves:
            steps = np.intersect1d(steps, curves[side.id][0])
    picks = np.unique(np.linspace(0, len(steps) - 1, min(CHECKPOINTS, len(steps))).round())
    checkpoints = [int(steps[int(i)]) for i in picks] if len(steps) else []
    for side in sides:
        if side.id in curves:
            at = dict(zip(curves[side.id][0].tolist(), curves[side.id][1].tolist(), strict=True))
            side.loss_at = [at.get(s) for s in checkpoints]
    return checkpoints, grid.size


def _speed(store: RunStore, sides: list[RunSide], totals: dict[str, dict[str, tuple]]) -> None:
    """Median tokens/s, step time and MFU of each run, where it records them."""
    wanted: dict[tuple[str, str], str] = {}  # (run, name) -> what
    for side in sides:
        names = list(totals.get(side.id, {}))
        step_ms = _user_metric(names, "step_ms") or (
            "profile/step/time_ms" if "profile/step/time_ms" in names else None
        )
        picks = {
            "tokens_per_s": _user_metric(names, "tokens_per_s"),
            "step_ms": step_ms,
            "mfu_frac": _user_metric(names, "mfu_frac"),
        }
        wanted.update({(side.id, n): what for what, n in picks.items() if n})
    if not wanted:
        return
    pairs = " OR ".join(f"(run = {sql_string(r)} AND name = {sql_string(n)})" for r, n in wanted)
    by_id = {s.id: s for s in sides}
    for run, name, median, mean in store.sql(
        f"SELECT run, name, median(value), avg(value) FROM metrics WHERE {pairs} GROUP BY ALL"
    ).fetchall():
        by_id[run].speed[wanted[run, name]] = Speed(name, float(median), float(mean))


# The alarms' records by run: the earliest label of each (a step label is the value),
# with the layer recorded beside it at the same record step.
_ALARMS = f"""
WITH a AS (
    SELECT run, name, step, value FROM metrics WHERE isfinite(value) AND name IN ({{names}})
), f AS (
    SELECT run, name, min(value) AS label, arg_min(step, value) AS at, min(step) AS first,
           sum(value) AS total
    FROM a GROUP BY ALL
)
SELECT f.run, f.name, f.label, f.first, f.total, min(c.value)
FROM f LEFT JOIN a c ON c.run = f.run AND (
    (f.name = '{OUTPUT_STEP}' AND c.name = '{OUTPUT_LAYER}' AND c.step = f.at)
    OR (f.name = '{MOVED_STEP}' AND c.name = '{MOVED_LAYER}' AND c.step = f.at)
    OR (f.name = '{GRAD_LAYER}' AND c.name = '{GRAD_LAYER}' AND c.step = f.first))
GROUP BY ALL
"""


# A step label's record -> (the Alarms field it fills, the field of the layer beside it).
_LABELS = {
    OUTPUT_STEP: ("output_step", "output_layer"),
    MOVED_STEP: ("moved_step", "moved_layer"),
    LOSS_STEP: ("loss_step", None),
    GRAD_NORM_STEP: ("grad_norm_step", None),
    LOSS_SPIKE: ("loss_spike_step", None),
    GRAD_NORM_SPIKE: ("grad_norm_spike_step", None),
}
_COUNTS = {LOSS_SPIKES: "loss_spikes", GRAD_NORM_SPIKES: "grad_norm_spikes"}


def _alarms(store: RunStore, sides: list[RunSide]) -> None:
    names = [*_LABELS, GRAD_LAYER, *_COUNTS]
    names += [OUTPUT_LAYER, MOVED_LAYER]  # read beside their steps, not on their own
    by_id = {s.id: s.alarms for s in sides}
    query = _ALARMS.format(names=", ".join(sql_string(n) for n in names))
    for run, name, label, first, total, companion in store.sql(query).fetchall():
        alarms = by_id[run]
        if name in _LABELS:
            step_field, layer_field = _LABELS[name]
            setattr(alarms, step_field, round(label))
            if layer_field:
                setattr(alarms, layer_field, _int(companion))
        elif name == GRAD_LAYER:  # the norms readouts: the record's step is the step
            alarms.grad_step, alarms.grad_layer = int(first), _int(companion)
        elif name in _COUNTS:
            setattr(alarms, _COUNTS[name], round(total))


# The monitors' raw moments and sums, recorded for the flush to derive the metrics the
# user reads (act_rms and act_kurtosis, grad_out_rms, the norms): not ranked themselves.
# Named here, not imported: the monitors' modules import torch, the CLI must not.
_RAW_METRICS = ("act_m2", "act_m4", "grad_out_sq")


def _layer_metrics(names: Sequence[str]) -> dict[str, tuple[int, str]]:
    """Per-layer monitor names -> (layer, metric); step labels (``*_first_step``) and
    raw moments are not values to rank."""
    out = {}
    for name in names:
        m = LAYER_NAME.fullmatch(name)
        if m and not _unranked(m.group(2)):
            out[name] = (int(m.group(1)), m.group(2))
    return out


def _unranked(metric: str) -> bool:
    return metric.endswith("_first_step") or "_sumsq_" in metric or metric in _RAW_METRICS


def _worst_layers(totals: dict[str, tuple]) -> dict[str, WorstLayer]:
    """Each per-layer monitor's worst layer: the highest max, or the lowest min."""
    best: dict[str, WorstLayer] = {}
    for name, (layer, metric) in _layer_metrics(list(totals)).items():
        row = totals[name]
        low = metric in LOWEST_IS_WORST
        value, step = (row[2], row[4]) if low else (row[3], row[5])
        if value is None:
            continue
        held = best.get(metric)
        if (
            held is None
            or _worse(value, held.value, low)
            or (value == held.value and layer < held.layer)
        ):
            best[metric] = WorstLayer(layer, float(value), int(step))
    return dict(sorted(best.items()))


def _worse(value: float, than: float, low: bool) -> bool:
    if math.isnan(value) != math.isnan(than):
        return math.isnan(value)  # a NaN is the worst value there is
    return value < than if low else value > than


def _moved(store: RunStore, sides: list[RunSide], totals: dict[str, dict[str, tuple]]) -> int:
    """The per-layer monitor (and layer) whose bucket means left the baseline's first,
    beyond noise, in each run. Returns the steps per bucket."""
    names = set.union(*(set(_layer_metrics(list(totals.get(s.id, {})))) for s in sides))
    if not names:
        return 1
    rows = [t for s in sides for n, t in totals.get(s.id, {}).items() if n in names]
    grid = Grid.spanning(min(r[7] for r in rows), max(r[8] for r in rows))
    listed = ", ".join(sql_string(n) for n in sorted(names))
    series = read_series(store, grid, where=f"name IN ({listed})", by_run=True)
    base = sides[0].id
    parsed = _layer_metrics(sorted(names))
    for side in sides[1:]:
        found = []
        for name, (layer, metric) in parsed.items():
            mine, theirs = series.get((side.id, name)), series.get((base, name))
            if mine is None or theirs is None:
                continue
            aligned = matching(theirs.steps, theirs.mean, mine.steps, mine.mean)
            step = divergence(*aligned).first_beyond_noise
            if step is not None:
                found.append(LayerMove(step, layer, metric))
        side.moved = min(found) if found else None
    return grid.size


def _section_changes(sides: list[RunSide]) -> list[SectionChange]:
    """The largest changes of a profile section's ms per step against the baseline."""
    base = sides[0].sections
    changes = []
    for side in sides[1:]:
        for section in sorted(set(base) | set(side.sections)):
            before, after = base.get(section), side.sections.get(section)
            change = (after or 0.0) - (before or 0.0)
            changes.append(SectionChange(section, side.id, before, after, change))
    changes.sort(key=lambda c: -abs(c.change_ms))
    return changes[:SECTIONS]


def _split(runs: np.ndarray, steps: np.ndarray, values: np.ndarray) -> dict[str, tuple]:
    """Rows sorted by run -> run -> (steps, values)."""
    out = {}
    if len(runs) == 0:
        return out
    starts = np.flatnonzero(np.r_[True, runs[1:] != runs[:-1]])
    for start, end in zip(starts, np.r_[starts[1:], len(runs)], strict=True):
        out[str(runs[start])] = (steps[start:end], values[start:end])
    return out


def _int(value: float | None) -> int | None:
    return None if value is None or not math.isfinite(value) else round(value)


def _plain(value: Any) -> Any:
    """JSON-ready: tuples to lists, numpy scalars to Python, NaN and Inf to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        fields = getattr(value, "_fields", None)
        if fields:  # a NamedTuple: keep its field names
            return {f: _plain(v) for f, v in zip(fields, value, strict=True)}
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
