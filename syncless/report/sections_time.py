"""Where step time goes: profiler sections per step, collective parts, the late rank
and its likely culprit, and the data plane's operations worst first."""

from __future__ import annotations

import numpy as np

from syncless.report.data import RunData, Series
from syncless.report.nesting import parents
from syncless.report.page_parts import Section, figure, table
from syncless.report.sections_run import step_time

__all__ = ["recorded_parents", "sections", "top_level"]

PARTS = ("enqueue", "rendezvous", "transfer")
# The profiler's own rows: never stacked as a section.
RESERVED = ("step", "self", "calibration")


def sections(data: RunData) -> list[Section]:
    return [s for s in (_profile(data), _dataplane(data)) if s]


def top_level(
    sections: dict[str, Series], step: Series | None, nesting: dict[str, str | None] | None = None
) -> list[str]:
    """The sections stacked as the step's parts, largest first.

    With the profiler's nesting records (``nesting``: name -> parent, from
    :func:`recorded_parents`), the children of the whole step: the sections whose
    parent is ``None``. Without them (runs recorded before the profiler wrote
    ``depth_count``/``order_count``), the old guess is kept as the fallback: the
    largest sections that fit in the step together, at every recorded step.
    """
    by_size = sorted(sections, key=lambda n: -_mean(sections[n]))
    if nesting:
        return [n for n in by_size if n in nesting and nesting[n] is None]
    # Fallback for runs without nesting records: a child's time is inside its parent's.
    chosen: list[str] = []
    used = np.zeros(step.mean.shape) if step is not None else 0.0
    for name in by_size:
        s = sections[name]
        if step is None:
            chosen.append(name)
            continue
        ms = np.interp(step.steps, s.steps, s.mean) if len(s.steps) else np.zeros_like(used)
        if np.all(used + ms <= step.mean * 1.02):  # 2%: timer granularity and rounding
            chosen.append(name)
            used = used + ms
    return chosen


def recorded_parents(data: RunData) -> dict[str, str | None]:
    """Each profiler row's parent, from its latest step bucket; {} for older runs.

    Taken from the last step bucket's mean over ranks (rounded): a row's depth never
    changes, so whether its parent is the whole step does not depend on the rank.
    """
    where: dict[str, tuple[int, int]] = {}
    for name, match in data.matching(r"profile/([^/]+)/depth_count").items():
        order = data.series.get(f"profile/{match.group(1)}/order_count")
        depth = data.series[name]
        if order is not None and depth.mean.size and order.mean.size:
            where[match.group(1)] = (round(depth.mean[-1]), round(order.mean[-1]))
    return parents(where)


def _profile(data: RunData) -> Section | None:
    import plotly.graph_objects as go

    timed = data.matching(r"profile/([^/]+)/time_ms")
    parts = data.matching(r"profile/([^/]+)/(enqueue|rendezvous|transfer)_ms")
    collectives = sorted({m.group(1) for m in parts.values()})
    plain = {
        m.group(1): data.series[n]
        for n, m in timed.items()
        if m.group(1) not in RESERVED and m.group(1) not in collectives
    }
    if not plain and not collectives:
        return None
    step = data.series.get("profile/step/time_ms")
    step_ms = float(np.nanmean(step.mean)) if step else sum(_mean(s) for s in plain.values())
    means = {name: _mean(s) for name, s in plain.items()}
    nesting = recorded_parents(data)
    # With nesting records, a collective directly inside the step is one of its parts too.
    outer = {c: data.series[f"profile/{c}/time_ms"] for c in collectives
             if nesting and f"profile/{c}/time_ms" in data.series}  # fmt: skip
    stacked = top_level(plain | outer, step, nesting)
    body = ""
    if stacked:
        fig = go.Figure()
        for name in stacked:
            s = plain.get(name) or outer[name]
            fig.add_bar(x=s.steps, y=s.mean, name=name)
        if step is not None:
            fig.add_scatter(x=step.steps, y=step.mean, name="step", mode="lines+markers")
        fig.update_layout(
            barmode="stack", title="Profiler sections per step (ms)", xaxis_title="step"
        )
        body += figure(fig, "profile-sections")
    rows = [(n, ms, 100 * ms / step_ms if step_ms else float("nan"), "stacked" if n in stacked else "nested")
            for n, ms in sorted(means.items(), key=lambda kv: -kv[1])]  # fmt: skip
    body += table(["section", "ms per step", "% of step", "in the chart"], rows)
    if collectives:
        body += _collectives(data, collectives)
    late = _late(data, list(plain))
    if late:
        body += late
    return Section("step-time", "Where step time goes", body)


def _collectives(data: RunData, collectives: list[str]) -> str:
    import plotly.graph_objects as go

    fig = go.Figure()
    for part in PARTS:
        values = [_mean(data.series.get(f"profile/{c}/{part}_ms")) for c in collectives]
        fig.add_bar(x=collectives, y=values, name=part)
    fig.update_layout(barmode="stack", title="Collectives: ms per step by part", yaxis_title="ms")
    rows = [
        (c, *(_mean(data.series.get(f"profile/{c}/{p}_ms")) for p in PARTS)) for c in collectives
    ]
    return (
        "<h3>Collectives</h3>"
        + figure(fig, "collectives")
        + table(["collective", *(f"{p} ms" for p in PARTS)], rows)
    )


def _late(data: RunData, plain: list[str]) -> str:
    """The late rank per collective (the profiler's, latest window) and the plain
    section that is slowest on it against the other ranks' median, over the run."""
    lates = data.matching(r"profile/([^/]+)/late_rank")
    rows = []
    for name, match in lates.items():
        late = round(float(data.series[name].high[-1]))
        culprit, excess = "-", 0.0
        for section in plain:
            per_rank = data.rank_means.get(f"profile/{section}/time_ms", {})
            others = [v for r, v in per_rank.items() if r != late]
            if late in per_rank and others:
                gap = per_rank[late] - float(np.median(others))
                if gap > excess:
                    culprit, excess = section, gap
        rows.append((match.group(1), late, culprit, excess))
    if not rows:
        return ""
    return (
        "<h3>Late rank</h3><p class='note'>The rank that reached each collective last in "
        "the latest window, and the section slowest on it against the other ranks' "
        "median over the run: a hint, not a proof.</p>"
        + table(["collective", "late rank", "likely culprit", "excess ms per step"], rows)
    )


def _dataplane(data: RunData) -> Section | None:
    import plotly.graph_objects as go

    ops = {
        m.group(1): data.series[n]
        for n, m in data.matching(r"dataplane/step/([^/]+)/wall_ms").items()
    }
    if not ops:
        return None
    measured = step_time(data)
    step_total = data.series[measured[0]].total if measured else 0.0
    rows = []
    for op, wall in sorted(ops.items(), key=lambda kv: -kv[1].total):
        mb = data.series.get(f"dataplane/step/{op}/mb")
        calls = data.series.get(f"dataplane/step/{op}/calls_count")
        errors = data.series.get(f"dataplane/step/{op}/errors_count")
        longest = data.series.get(f"dataplane/step/{op}/max_ms")
        share = 100 * wall.total / step_total if step_total else float("nan")
        rows.append((op, share, wall.total, mb.total if mb else 0.0, int(calls.total) if calls else 0,
                     float(np.nanmax(longest.high)) if longest else float("nan"),
                     int(errors.total) if errors else 0))  # fmt: skip
    fig = go.Figure(
        go.Bar(x=[r[1] for r in rows][::-1], y=[r[0] for r in rows][::-1], orientation="h")
    )
    fig.update_layout(title="Data-plane time, % of step time", xaxis_title="% of step time")
    header = ["op", "% of step time", "total ms", "total MB", "calls", "longest call ms", "errors"]
    worst = rows[0]
    text = f'<p class="worst" id="worst-dataplane">most time: {worst[0]} ({worst[1]:.3g}% of step time)</p>'
    return Section(
        "dataplane",
        "Data plane",
        text + table(header, rows) + figure(fig, "dataplane", height=120 + 40 * len(rows)),
    )


def _mean(series: Series | None) -> float:
    return float(np.nanmean(series.mean)) if series is not None and series.mean.size else 0.0
