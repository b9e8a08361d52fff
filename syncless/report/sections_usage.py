"""Captures (counts, bytes, drops by reason, windows) and what syncless itself cost."""

from __future__ import annotations

import numpy as np

from syncless.report.data import RunData
from syncless.report.page_parts import Section, figure, table
from syncless.report.sections_run import step_time

__all__ = ["sections"]

# capture/step/<name>_count totals shown as the window line, in this order.
WINDOWS = (
    "planned",
    "grants",
    "launched",
    "transfers",
    "overruns",
    "issued_late",
    "close_late",
    "missed",
    "plan_dropped",
)


def sections(data: RunData) -> list[Section]:
    return [s for s in (_captures(data), _self_cost(data)) if s]


def _total(data: RunData, name: str) -> float:
    series = data.series.get(name)
    return series.total if series is not None else 0.0


def _captures(data: RunData) -> Section | None:
    import plotly.graph_objects as go

    if not data.captures and not data.has("capture/step/captured_count"):
        return None
    rows: list[tuple[str, object, object]] = []
    for what in ("offered", "captured", "stored"):
        count, size = (_total(data, f"capture/step/{what}_{u}") for u in ("count", "bytes"))
        rows.append((what, int(count), size / 1e6))
    body = table(["tensors", "count", "MB"], rows)
    drops = {m.group(1): (_total(data, n), _total(data, f"capture/step/dropped_{m.group(1)}_bytes"))
             for n, m in data.matching(r"capture/step/dropped_(.+)_count").items()}  # fmt: skip
    dropped = {k: v for k, v in drops.items() if v[0] > 0}
    if dropped:
        worst = max(dropped, key=lambda k: dropped[k][0])
        body += (f'<p class="worst" id="worst-drops">most drops: {worst} '
                 f"({int(dropped[worst][0])} tensors)</p>")  # fmt: skip
        fig = go.Figure(go.Bar(x=list(dropped), y=[v[0] for v in dropped.values()]))
        fig.update_layout(title="Dropped captures by reason", yaxis_title="tensors")
        body += figure(fig, "capture-drops", height=300)
    elif drops:
        body += '<p class="note">No capture was dropped.</p>'
    if drops:
        body += table(
            ["drop reason", "tensors", "MB"],
            [(k, int(c), b / 1e6) for k, (c, b) in sorted(drops.items())],
        )
    windows = [(w, int(_total(data, f"capture/step/window_{w}_count"))) for w in WINDOWS
               if data.has(f"capture/step/window_{w}_count")]  # fmt: skip
    if windows:
        body += "<h3>Capture windows</h3>" + table(["windows", "count"], windows)
    if data.captures:
        body += "<h3>Stored captures by tag</h3>" + table(
            ["tag", "count", "MB"], [(t, n, b / 1e6) for t, n, b in data.captures]
        )
    return Section("captures", "Captures", body)


def _self_cost(data: RunData) -> Section | None:
    import plotly.graph_objects as go

    names = [n for n in sorted(data.series) if "/self/" in n]
    if not names:
        return None
    measured = step_time(data)
    step_ms = measured[1] if measured else float("nan")
    rows = []
    shares: dict[str, float] = {}
    for name in names:
        s = data.series[name]
        mean = float(np.nanmean(s.mean))
        share = float("nan")
        # Only times compare with the step time; the step's own measurement is the
        # reference, not a cost.
        if name.endswith("_ms") and not name.endswith("/step_ms"):
            share = 100 * mean / step_ms
            shares[name] = share
        rows.append((name, mean, float(np.nanmax(s.high)), share))
    reference = f"{step_ms:.4g} ms ({measured[0]})" if measured else "not recorded"
    body = (
        f'<p class="note">Every <code>*/self/*</code> metric syncless wrote about itself. '
        f"Times are per step where recorded, set against the mean step time: {reference}.</p>"
    )
    if shares and measured:
        order = sorted(shares, key=shares.__getitem__)
        fig = go.Figure(go.Bar(x=[shares[n] for n in order], y=order, orientation="h"))
        fig.update_layout(title="syncless's own time, % of step time", xaxis_title="% of step time")
        body += figure(fig, "self-cost", height=120 + 24 * len(order))
    body += table(["metric", "mean", "max", "% of step time"], rows)
    return Section("self-cost", "What syncless cost", body)
