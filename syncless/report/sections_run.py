"""The report's first sections: the run itself, and its training curves."""

from __future__ import annotations

import html
import json
import time

import numpy as np

from syncless.report.data import RunData
from syncless.report.page_parts import Section, band, figure, table
from syncless.report.summary import mfu_text

__all__ = ["SYNCLESS_AREAS", "sections", "step_time"]

#: Metric areas syncless writes itself; any other ``area/step/*`` is the user's curve.
SYNCLESS_AREAS = ("monitors", "profile", "dataplane", "capture")
# Curves shown first, in this order; other user step metrics follow by name.
FIRST = ("loss", "lr", "step_ms", "tokens_per_s")


def sections(data: RunData) -> list[Section]:
    out = [_overview(data)]
    curves = _curves(data)
    if curves:
        out.append(curves)
    return out


def step_time(data: RunData) -> tuple[str, float] | None:
    """The metric that measures the step, and its mean in ms: the user's ``*/step/step_ms``,
    else the profiler's step, else the monitors' own measurement."""
    names = [n for n in user_curves(data) if n.endswith("/step_ms")]
    names += ["profile/step/time_ms", "monitors/self/step_ms"]
    for name in names:
        if data.has(name):
            return name, float(np.nanmean(data.series[name].mean))
    return None


def user_curves(data: RunData) -> list[str]:
    """``area/step/name`` metrics outside syncless's own areas, the FIRST ones first."""
    names = [
        n for n in data.matching(r"([^/]+)/step/([^/]+)") if n.split("/")[0] not in SYNCLESS_AREAS
    ]
    rank = {
        n: (FIRST.index(n.split("/")[2]) if n.split("/")[2] in FIRST else len(FIRST), n)
        for n in names
    }
    return sorted(names, key=rank.__getitem__)


def _overview(data: RunData) -> Section:
    info = data.info
    rows: list[tuple[str, object]] = [("name", info.get("name", "?"))]
    if info.get("start_time"):
        rows.append(
            ("started", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["start_time"])))
        )
    world = info.get("world_size")
    ranks = data.ranks
    seen = (
        f"{len(ranks)} with metrics ({', '.join(map(str, ranks))})"
        if ranks
        else "none with metrics"
    )
    rows.append(("world size", f"{world if world is not None else '?'}; ranks: {seen}"))
    if world and len(ranks) < int(world):
        rows.append(("note", f"{int(world) - len(ranks)} rank(s) wrote no readable shard"))
    by = f" by rank {ranks[0]}" if len(ranks) > 1 else ""
    rows.append(("steps", f"{data.steps} recorded{by}, {data.first_step} to {data.last_step}"))
    if data.start_time is not None and data.end_time is not None:
        duration = data.end_time - data.start_time
        rows.append(("duration", f"{duration:.1f} s (first to last record)"))
        if duration > 0 and data.steps > 1:
            rows.append(("steps per second", f"{(data.steps - 1) / duration:.3g}"))
    tokens = [n for n in user_curves(data) if n.endswith("/tokens_per_s")]
    if tokens:
        rate = float(np.nanmean(data.series[tokens[0]].mean))
        rows.append(("tokens per second", f"{rate:,.0f} (mean per rank, {tokens[0]})"))
    mfu = _mfu(data)
    if mfu:
        rows.append(("MFU", mfu))
    measured = step_time(data)
    if measured:
        rows.append(("step time", f"{measured[1]:.4g} ms (mean, {measured[0]})"))
    segments = info.get("segments") or []
    if len(segments) > 1:
        rows.append(("segments", f"{len(segments)} (resumed {len(segments) - 1} time(s))"))
    body = table(["", ""], rows)
    env = info.get("env") or {}
    versions = [
        (k, env[k])
        for k in ("syncless", "torch", "python", "cuda", "gpu", "host", "git_commit")
        if env.get(k)
    ]
    if versions:
        body += "<h3>Versions</h3>" + table(["", ""], versions)
    config = info.get("config")
    if config:
        text = html.escape(json.dumps(config, indent=1, default=str))
        body += (
            f"<details><summary>config ({len(config)} keys)</summary><pre>{text}</pre></details>"
        )
    return Section("run", "Run", body)


def _mfu(data: RunData) -> str | None:
    names = [n for n in user_curves(data) if n.endswith("/mfu_frac")]
    mean = float(np.nanmean(data.series[names[0]].mean)) if names else None
    return mfu_text(mean, data.info.get("config") or {}, names[0] if names else "")


def _curves(data: RunData) -> Section | None:
    names = user_curves(data)
    if not names:
        return None
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    columns = 2
    rows = (len(names) + columns - 1) // columns
    fig = make_subplots(rows=rows, cols=columns, subplot_titles=names, vertical_spacing=0.3 / rows)
    color = qualitative.Plotly[0]
    for i, name in enumerate(names):
        band(fig, data.series[name], name, color, row=i // columns + 1, col=i % columns + 1)
    fig.update_layout(showlegend=False)
    over = ["ranks"] if len(data.ranks) > 1 else []
    if data.bucket > 1:
        over.append(f"the {data.bucket} steps of a bucket")
    note = ""
    if over:
        note = (
            f'<p class="note">A line is the mean over {" and ".join(over)}; the band around '
            "it spans the lowest and highest value there, so a spike on any rank or step "
            "shows.</p>"
        )
    return Section("curves", "Training curves", note + figure(fig, "curves", height=260 * rows))
