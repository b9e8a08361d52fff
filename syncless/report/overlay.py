"""``syncless report RUN_A RUN_B ...``: several runs overlaid on one self-contained page.

:func:`load` reads the runs as one store (``syncless.run.open_runs``) in two scans:
which metrics each run has, then every shared metric's min/max bands per step bucket
on one grid, run by run (``report/bands.py``; both through the shards' rollups where
compaction wrote them). The page has the runs and their config
differences, a chart per metric they share (each run a line and its band), and the
per-layer monitors as heatmaps, side by side or, one click away, as the difference
from the first run. Size is budgeted: more runs and metrics get wider buckets, so
forty runs still make a page of a few MB.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from syncless.report import html as page
from syncless.report.bands import MAX_COLUMNS, Grid, Series, read_series, read_spans
from syncless.report.compare import check_shared
from syncless.report.config_diff import ConfigDiff, diff_configs
from syncless.report.data import LAYER_NAME, Cells, layer_cells
from syncless.report.page_parts import Section, band, f4, figure, table
from syncless.report.sections_layers import HEATMAPS, LOWEST_IS_WORST
from syncless.report.sections_run import SYNCLESS_AREAS
from syncless.run.runset import RunEntry
from syncless.run.storage import RunPath, run_path
from syncless.run.store import RunStore, sql_string

__all__ = ["DEFAULT_OUTPUT", "Overlay", "build", "load", "sections", "write"]

#: Where ``syncless report RUN_A RUN_B`` writes without ``-o``: a page about several
#: runs belongs to none of them.
DEFAULT_OUTPUT = "syncless-compare.html"
#: Chart points on a page (runs x metrics x 3 lines x buckets): past it, buckets widen.
POINTS = 600_000
#: Heatmap cells on a page (runs x metrics x layers x buckets, values and differences).
CELLS = 1_000_000
#: Fewest buckets a chart or heatmap gets, however many runs and metrics.
MIN_COLUMNS = 50
# Per-layer monitors drawn as heatmaps: the single-run report's. Lower is worse for
# entropy.
LAYER_MAPS = tuple(h.metric for h in HEATMAPS)
FIRST = ("loss", "lr", "step_ms", "tokens_per_s", "mfu_frac", "grad_norm")


@dataclass
class Overlay:
    """Several runs on one step grid: what the page draws."""

    runs: list[RunEntry]
    config: ConfigDiff
    spans: dict[str, tuple[int, int, int]]  # run -> first step, last step, records
    shared: list[str]  # metrics every run has, not per layer, in page order
    only_some: int  # metrics some runs lack
    grid: Grid
    series: dict[tuple[str, str], Series] = field(default_factory=dict)  # (run, name)
    layer_grid: Grid | None = None
    layers: dict[str, dict[str, Cells]] = field(default_factory=dict)  # metric -> run -> Cells


def load(store: RunStore) -> Overlay:
    """Read what the page needs from a store of several runs."""
    spans: dict[str, tuple[int, int, int]] = {}
    names: dict[str, dict[str, tuple[int, int]]] = {}
    for run, name, first, last, records in read_spans(store):
        names.setdefault(run, {})[name] = (first, last)
        low, high, count = spans.get(run, (first, last, 0))
        spans[run] = (min(low, first), max(high, last), count + records)
    check_shared(store.runs, [set(names.get(r.id, {})) for r in store.runs])
    common = set.intersection(*(set(names[r.id]) for r in store.runs))
    plain = _page_order([n for n in common if not n.startswith("monitors/layer_")])
    layered = sorted(n for n in common if _layer_metric(n) in LAYER_MAPS)
    first = min(s[0] for s in spans.values())
    last = max(s[1] for s in spans.values())
    runs = len(store.runs)
    overlay = Overlay(
        runs=list(store.runs),
        config=diff_configs(store.runs),
        spans=spans,
        shared=plain,
        only_some=len(set().union(*(set(n) for n in names.values())) - common),
        grid=Grid.spanning(first, last, _columns(POINTS, runs * 3 * len(plain))),
    )
    if plain:
        overlay.series = read_series(store, overlay.grid, where=_names_in(plain), by_run=True)
    if layered:
        depth = len({LAYER_NAME.fullmatch(n).group(1) for n in layered})
        metrics = len({_layer_metric(n) for n in layered})
        overlay.layer_grid = Grid.spanning(first, last, _columns(CELLS, runs * 2 * depth * metrics))
        found = read_series(store, overlay.layer_grid, where=_names_in(layered), by_run=True)
        for entry in store.runs:
            mine = {name: s for (run, name), s in found.items() if run == entry.id}
            for metric, cells in layer_cells(mine, LAYER_MAPS).items():
                overlay.layers.setdefault(metric, {})[entry.id] = cells
    return overlay


def build(paths: Sequence[str]) -> str:
    """The page of the runs at ``paths`` (run directories, folders of runs)."""
    with RunStore(list(paths)) as store:
        if len(store.runs) == 1:  # one run found: its own report
            return page.build(str(store.runs[0].path))
        overlay = load(store)
    title = f"{len(overlay.runs)} runs ({', '.join(r.id for r in overlay.runs[:3])}"
    title += ", ...)" if len(overlay.runs) > 3 else ")"
    return page.document(title, sections(overlay))


def write(paths: Sequence[str], output: str | None = None) -> RunPath:
    """Write the page (default ./syncless-compare.html); return its path."""
    return page.save(run_path(output or DEFAULT_OUTPUT), build(paths))


def sections(overlay: Overlay) -> list[Section]:
    out = [_runs(overlay)]
    if overlay.shared:
        out.append(_charts(overlay))
    if overlay.layers:
        out.append(_heatmaps(overlay))
    return out


def _runs(o: Overlay) -> Section:
    rows = []
    for r in o.runs:
        first, last, records = o.spans.get(r.id, (0, 0, 0))
        start = r.info.get("start_time")
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(start)) if start else "?"
        rows.append((r.id, str(r.info.get("name", "")), when, f"{first} to {last}", records,
                     str(r.info.get("world_size", "?")), str(r.path)))  # fmt: skip
    body = table(["run", "name", "started", "steps", "records", "world size", "path"], rows)
    body += f"<h3>Config: {len(o.config.differences)} key(s) differ, {o.config.same} the same</h3>"
    if o.config.differences:
        body += _scrolling(
            table(["key", *(_label(r.id, i) for i, r in enumerate(o.runs))],
                  [(d.key, *(_value(v) for v in d.values)) for d in o.config.differences])
        )  # fmt: skip
    for r in o.runs:
        config = html.escape(_json(r.info.get("config") or {}))
        body += f"<details><summary>config of {html.escape(r.id)}</summary><pre>{config}</pre></details>"
    return Section("runs", "Runs", body)


def _charts(o: Overlay) -> Section:
    import plotly.graph_objects as go

    colors = _colors(len(o.runs))
    parts = [
        f'<p class="note">Every metric the {len(o.runs)} runs share, on one step axis. '
        "A line is a run's mean over ranks"
        + (f" and the {o.grid.size} steps of a bucket" if o.grid.size > 1 else "")
        + "; the band around it spans its lowest and highest value there, so a spike "
        f"on any rank shows. {o.only_some} metric(s) only some runs have are left out.</p>"
    ]
    for i, name in enumerate(o.shared):
        fig = go.Figure()
        for run, color in zip(o.runs, colors, strict=True):
            s = o.series.get((run.id, name))
            if s is not None:
                band(fig, s, run.id, color)
        fig.update_layout(title=name, xaxis_title="step", hovermode="x", legend={"title": "run"})
        parts.append(figure(fig, f"overlay-{i}", height=300))
    return Section("metrics", "Metrics they share", "".join(parts))


def _heatmaps(o: Overlay) -> Section:
    grid = o.layer_grid
    note = (
        '<p class="note">Layer x step, each run in its own panel on one color scale '
        "(the worst value of a bucket and of every rank). <b>difference from "
        f"{html.escape(o.runs[0].id)}</b> shows each run minus the first. Monitors record "
        "at each run's own cadence: a reading holds until that run's next one, up to its "
        "last." + (f" {grid.size} steps a column." if grid and grid.size > 1 else "") + "</p>"
    )
    parts = [note]
    for metric in LAYER_MAPS:
        if metric in o.layers:
            parts.append(_heatmap(o, metric, o.layers[metric]))
    return Section("layers", "Per-layer monitors", "".join(parts))


def _heatmap(o: Overlay, metric: str, by_run: dict[str, Cells]) -> str:
    from plotly.subplots import make_subplots

    runs = [r.id for r in o.runs if r.id in by_run]
    low = metric in LOWEST_IS_WORST
    layers = np.unique(np.concatenate([by_run[r].rows for r in runs]))
    columns = np.unique(np.concatenate([by_run[r].columns for r in runs]))
    values = {r: _aligned(by_run[r], layers, columns, low) for r in runs}
    base = values[runs[0]]
    with np.errstate(invalid="ignore"):
        diffs = {r: _held(values[r]) - _held(base) for r in runs}
    per_row = min(3, len(runs))
    rows = math.ceil(len(runs) / per_row)
    fig = make_subplots(rows=rows, cols=per_row, subplot_titles=runs, shared_yaxes=True,
                        horizontal_spacing=0.04, vertical_spacing=0.3 / rows)  # fmt: skip
    for i, r in enumerate(runs):
        fig.add_heatmap(z=f4(values[r]), x=columns, y=layers, coloraxis="coloraxis",
                        hovertemplate="step %{x}<br>layer %{y}<br>%{z:.4g}<extra>" + r + "</extra>",
                        row=i // per_row + 1, col=i % per_row + 1)  # fmt: skip
    spread = max([_nanmax(diffs[r]) for r in runs[1:]], default=0.0) or 1.0
    difference = {"colorscale": "RdBu_r", "cmin": -spread, "cmax": spread,
                  "colorbar": {"x": 1.08, "title": {"text": "- base"}}}  # fmt: skip
    fig.update_layout(
        title=metric,
        coloraxis={"colorscale": "Viridis_r" if low else "Viridis", "colorbar": {"x": 1.0}},
        coloraxis2=difference,
        updatemenus=[_switch(runs, values, diffs, y=1.12 + 0.05 * rows)],
    )
    callout = _callout(metric, runs, values, diffs, layers, columns, low)
    height = min(1600, 80 + rows * max(200, 18 * len(layers) + 60))
    text = (
        f'<h3>{html.escape(metric)}</h3><p class="worst" id="worst-overlay-{metric}">{callout}</p>'
    )
    return text + figure(fig, f"overlay-layers-{metric}", height=height)


def _switch(
    runs: list[str], values: dict[str, np.ndarray], diffs: dict[str, np.ndarray], y: float
) -> dict[str, Any]:
    """Two buttons: every panel's values, or each run minus the first (the first keeps
    its values, on the values' scale)."""
    shown = {"z": [_nested(values[r]) for r in runs], "coloraxis": ["coloraxis"] * len(runs)}
    apart = {
        "z": [_nested(values[runs[0]])] + [_nested(diffs[r]) for r in runs[1:]],
        "coloraxis": ["coloraxis"] + ["coloraxis2"] * (len(runs) - 1),
    }
    buttons = [
        {"label": "values", "method": "restyle", "args": [shown]},
        {"label": f"difference from {runs[0]}", "method": "restyle", "args": [apart]},
    ]
    return {"type": "buttons", "direction": "right", "x": 0, "y": y, "xanchor": "left",
            "buttons": buttons}  # fmt: skip


def _callout(
    metric: str,
    runs: list[str],
    values: dict[str, np.ndarray],
    diffs: dict[str, np.ndarray],
    layers: np.ndarray,
    columns: np.ndarray,
    low: bool,
) -> str:
    """The worst cell of any run, and the largest difference from the first run."""
    parts = []
    pick = np.nanargmin if low else np.nanargmax
    worst = [(r, values[r]) for r in runs if not np.all(np.isnan(values[r]))]
    if worst:
        run, z = (
            min(worst, key=lambda w: float(np.nanmin(w[1])))
            if low
            else max(worst, key=lambda w: float(np.nanmax(w[1])))
        )
        r, c = np.unravel_index(pick(z), z.shape)
        what = "lowest" if low else "highest"
        parts.append(f"{what}: {html.escape(run)}, layer {layers[r]} at step {columns[c]} "
                     f"({z[r, c]:.4g})")  # fmt: skip
    moved = [(r, diffs[r]) for r in runs[1:] if not np.all(np.isnan(diffs[r]))]
    if moved:
        run, z = max(moved, key=lambda m: float(np.nanmax(np.abs(m[1]))))
        r, c = np.unravel_index(np.nanargmax(np.abs(z)), z.shape)
        parts.append(f"largest difference from {html.escape(runs[0])}: {html.escape(run)}, "
                     f"layer {layers[r]} at step {columns[c]} ({z[r, c]:+.4g})")  # fmt: skip
    return "; ".join(parts) or "nothing recorded"


def _aligned(cells: Cells, layers: np.ndarray, columns: np.ndarray, low: bool) -> np.ndarray:
    """A run's cells on the page's layers and columns (NaN where it recorded none)."""
    out = np.full((len(layers), len(columns)), np.nan)
    r = np.searchsorted(layers, cells.rows)
    c = np.searchsorted(columns, cells.columns)
    out[np.ix_(r, c)] = cells.low if low else cells.high
    return out


def _held(z: np.ndarray) -> np.ndarray:
    """Each gap in a row filled with the last value recorded before it, up to the row's
    last record: the monitors' cadence follows each run's own budget, so two runs
    rarely record the same steps, and a reading holds until the next."""
    columns = np.arange(z.shape[1])
    seen = ~np.isnan(z)
    at = np.maximum.accumulate(np.where(seen, columns, 0), axis=1)
    held = z[np.arange(z.shape[0])[:, None], at]
    last = np.where(seen.any(axis=1), z.shape[1] - 1 - np.argmax(seen[:, ::-1], axis=1), -1)
    held[columns[None, :] > last[:, None]] = np.nan
    return held


def _page_order(names: list[str]) -> list[str]:
    """The user's step curves first (loss, lr, ... in FIRST's order), then the rest by name."""

    def key(name: str) -> tuple[int, int, str]:
        parts = name.split("/")
        mine = len(parts) == 3 and parts[1] == "step" and parts[0] not in SYNCLESS_AREAS
        first = FIRST.index(parts[2]) if mine and parts[2] in FIRST else len(FIRST)
        return (0 if mine else 1, first, name)

    return sorted(names, key=key)


def _layer_metric(name: str) -> str | None:
    m = LAYER_NAME.fullmatch(name)
    return m.group(2) if m else None


def _names_in(names: list[str]) -> str:
    return f"name IN ({', '.join(sql_string(n) for n in names)})"


def _columns(budget: int, per_column: int) -> int:
    return max(MIN_COLUMNS, min(MAX_COLUMNS, budget // max(1, per_column)))


def _colors(n: int) -> list[str]:
    from plotly.colors import qualitative

    palette = qualitative.Plotly if n <= 10 else qualitative.Alphabet
    return [palette[i % len(palette)] for i in range(n)]


def _nested(z: np.ndarray) -> list:
    """A matrix for a button's arguments (plain JSON), NaN as null, 4 significant digits."""
    finite = np.isfinite(z) & (z != 0)
    digits = np.zeros(z.shape)
    digits[finite] = 3 - np.floor(np.log10(np.abs(z[finite])))
    rounded = np.round(z * 10.0**digits) / 10.0**digits
    out = rounded.astype(object)
    out[np.isnan(z)] = None
    return out.tolist()


def _nanmax(z: np.ndarray) -> float:
    return float(np.nanmax(np.abs(z))) if not np.all(np.isnan(z)) else 0.0


def _label(run: str, i: int) -> str:
    return f"{run} (base)" if i == 0 else run


def _value(value: Any) -> str:
    return "-" if value is None else str(value)


def _scrolling(body: str) -> str:
    return f'<div style="overflow-x: auto">{body}</div>'


def _json(value: Any) -> str:
    import json

    return json.dumps(value, indent=1, default=str)
