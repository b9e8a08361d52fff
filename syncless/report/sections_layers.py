"""Per-layer heatmaps (layer x step) and head/expert x layer grids, each with its worst
cell named in a line of text above the chart."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from syncless.report.data import Cells, RunData
from syncless.report.page_parts import Section, figure

__all__ = ["HEATMAPS", "LOWEST_IS_WORST", "Heatmap", "sections", "worst_cell"]


class Heatmap(NamedTuple):
    """A per-layer metric drawn as a heatmap."""

    metric: str  # the part after monitors/layer_NN/
    title: str
    worst: str  # "max" or "min": which end is the alarming one
    section: str  # the page section it goes in


HEATMAPS = (
    Heatmap("attn_qk_logit_max", "Attention QK logit max", "max", "attention"),
    Heatmap("attn_entropy_nats", "Attention entropy (nats)", "min", "attention"),
    Heatmap("act_absmax", "Activation max |x|", "max", "activations"),
    Heatmap("act_rms", "Activation RMS", "max", "activations"),
    # Heavy tails grow before a massive activation does (a kurtosis of 0 is Gaussian).
    Heatmap("act_kurtosis", "Activation excess kurtosis", "max", "activations"),
    Heatmap("nonfinite_count", "Nonfinite values", "max", "activations"),
    Heatmap("grad_out_rms", "Output gradient RMS", "max", "optimizer"),
    Heatmap("grad_out_absmax", "Output gradient max |g|", "max", "optimizer"),
    Heatmap("grad_out_nonfinite_count", "Nonfinite output gradients", "max", "optimizer"),
    Heatmap("grad_norm", "Gradient norm", "max", "optimizer"),
    Heatmap("update_ratio", "Update / parameter norm", "max", "optimizer"),
    Heatmap("moe_imbalance", "Expert imbalance (max / mean load)", "max", "experts"),
    Heatmap("moe_tokens_count", "Tokens routed per layer", "max", "experts"),
)
#: Per-layer metrics whose lowest value is the alarming one; every other is worst high.
LOWEST_IS_WORST = frozenset(h.metric for h in HEATMAPS if h.worst == "min")
SUB_GRIDS = {  # metric -> (what a row is, title)
    "attn_qk_logit_max": ("head", "QK logit max per head"),
    "attn_entropy_nats": ("head", "Attention entropy per head (nats)"),
    "moe_tokens_count": ("expert", "Tokens per expert"),
}
TITLES = {
    "attention": "Attention",
    "activations": "Activations and nonfinite values",
    "optimizer": "Gradients and updates",
    "experts": "Experts",
}


class Worst(NamedTuple):
    row: int  # layer (or head/expert) id
    column: int  # step (or layer id)
    value: float


def worst_cell(cells: Cells, worst: str) -> Worst | None:
    """The alarming cell: the highest of the per-rank maxima, or the lowest minimum."""
    z = cells.high if worst == "max" else cells.low
    if np.all(np.isnan(z)):
        return None
    flat = np.nanargmax(z) if worst == "max" else np.nanargmin(z)
    r, c = np.unravel_index(flat, z.shape)
    return Worst(int(cells.rows[r]), int(cells.columns[c]), float(z[r, c]))


def sections(data: RunData) -> list[Section]:
    bodies: dict[str, list[str]] = {}
    for spec in HEATMAPS:
        parts = []
        if spec.metric in data.layers:
            parts.append(_layer_map(data, spec))
        if spec.metric in data.subs:
            parts.append(_sub_map(data, spec))
        if parts:
            bodies.setdefault(spec.section, []).extend(parts)
    return [Section(key, TITLES[key], "".join(parts)) for key, parts in bodies.items()]


def _layer_map(data: RunData, spec: Heatmap) -> str:

    cells = data.layers[spec.metric]
    z = cells.high if spec.worst == "max" else cells.low
    worst = worst_cell(cells, spec.worst)
    what = "highest" if spec.worst == "max" else "lowest"
    if worst is None:
        callout = "nothing recorded"
    elif spec.metric == "nonfinite_count" and worst.value == 0:
        callout = "no nonfinite value in any layer"
    else:
        callout = f"{what}: layer {worst.row} at step {worst.column} ({worst.value:.4g})"
    fig = _heatmap(z, cells, spec, "step %{x}<br>layer %{y}<br>%{z:.4g}<extra></extra>")
    fig.update_layout(title=spec.title, xaxis_title="step", yaxis_title="layer")
    fig.update_yaxes(dtick=_tick(len(cells.rows)))
    over = "worst rank" if len(data.ranks) > 1 else ""
    bucket = f"{data.bucket} steps a column" if data.bucket > 1 else ""
    how = ", ".join(x for x in (over, bucket) if x)
    note = f" <span class='note'>({how})</span>" if how else ""
    anchor = f"layers-{spec.metric}"
    text = f'<h3>{spec.title}</h3><p class="worst" id="worst-{anchor}">{callout}</p>'
    return text + note + figure(fig, anchor, height=_height(len(cells.rows)))


def _sub_map(data: RunData, spec: Heatmap) -> str:

    cells = data.subs[spec.metric]
    kind, title = SUB_GRIDS.get(spec.metric, ("index", spec.metric))
    z = cells.high if spec.worst == "max" else cells.low
    callout = _sub_callout(cells, spec, kind)
    fig = _heatmap(z, cells, spec, f"layer %{{x}}<br>{kind} %{{y}}<br>%{{z:.4g}}<extra></extra>")
    fig.update_layout(title=f"{title}, step {cells.step}", xaxis_title="layer", yaxis_title=kind)
    fig.update_xaxes(dtick=_tick(len(cells.columns)))
    fig.update_yaxes(dtick=_tick(len(cells.rows)))
    anchor = f"{kind}s-{spec.metric}"
    text = f'<h3>{title} (step {cells.step})</h3><p class="worst" id="worst-{anchor}">{callout}</p>'
    return text + figure(fig, anchor, height=_height(len(cells.rows)))


def _sub_callout(cells: Cells, spec: Heatmap, kind: str) -> str:
    worst = worst_cell(cells, spec.worst)
    if worst is None:
        return "nothing recorded"
    what = "highest" if spec.worst == "max" else "lowest"
    text = f"{what}: layer {worst.column} {kind} {worst.row} ({worst.value:.4g})"
    if kind == "expert":
        # Load is relative: the busiest expert against its layer's mean load, and
        # the idlest, since a dead expert is the other failure.
        column = int(np.flatnonzero(cells.columns == worst.column)[0])
        mean = float(np.nanmean(cells.high[:, column]))
        if mean > 0:
            text += f", {worst.value / mean:.2f}x its layer's mean"
        idle = worst_cell(cells, "min")
        if idle is not None:
            text += f"; idlest: layer {idle.column} expert {idle.row} ({idle.value:.4g})"
    return text


def _height(rows: int) -> int:
    return int(min(700, max(260, 120 + 22 * rows)))


def _tick(ids: int) -> int:
    """Integer ticks (layers, heads, experts are whole numbers), about 20 at most."""
    return max(1, ids // 20)


def _heatmap(z, cells, spec: Heatmap, hover: str):
    """A heatmap of ``z`` over ``cells``' columns and rows, the worst end of the scale
    bright whichever way ``spec`` counts worst."""
    import plotly.graph_objects as go

    scale = "Viridis" if spec.worst == "max" else "Viridis_r"
    trace = go.Heatmap(z=z, x=cells.columns, y=cells.rows, colorscale=scale, hovertemplate=hover)
    return go.Figure(trace)
