"""``syncless report RUN_DIR``: one self-contained HTML file about a run.

:func:`build` loads the run (``report/data.py``), asks each section module
(``report/sections_*.py``) for its sections and assembles the page: inline CSS,
plotly.js inlined once, then every figure as a div and a script. The sections are
built from the parts in ``report/page_parts.py``. Sections a run lacks are left out. The user's view is
``docs/report.md``.
"""

from __future__ import annotations

import html
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from syncless.errors import UsageError
from syncless.report import (
    sections_layers,
    sections_run,
    sections_stragglers,
    sections_time,
    sections_usage,
)
from syncless.report.page_parts import Section, figure, table
from syncless.run.storage import RunPath, run_path, write_whole

if TYPE_CHECKING:
    from syncless.report.data import RunData

__all__ = ["Section", "build", "document", "figure", "save", "table", "write"]

log = logging.getLogger(__name__)

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1200px;
       padding: 0 24px 48px; color: #1d1d1f; }
h1 { font-size: 24px; margin: 24px 0 4px; }
h2 { font-size: 19px; margin: 36px 0 8px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; margin: 20px 0 4px; }
nav a { margin-right: 12px; }
table { border-collapse: collapse; margin: 8px 0; }
td, th { padding: 2px 10px; border-bottom: 1px solid #eee; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.note { color: #555; }
.worst { background: #fff4e5; border-left: 3px solid #f0a030; padding: 4px 10px; }
.warn { background: #fdecea; border-left: 3px solid #d93025; padding: 4px 10px; }
.alarm { background: #fdecea; border: 2px solid #d93025; border-radius: 4px;
         padding: 8px 14px; margin: 12px 0; font-weight: 600; }
.alarm p { margin: 2px 0; }
.chart { min-height: 320px; }
"""


def sections(data: RunData) -> list[Section]:
    """Every section the run has data for, in page order."""
    builders: list[Callable[[RunData], list[Section]]] = [
        sections_run.sections,
        sections_layers.sections,
        sections_time.sections,
        sections_usage.sections,
    ]
    return [s for build_sections in builders for s in build_sections(data)]


def build(run_dir: str | Path) -> str:
    """The report of ``run_dir`` as one HTML document."""
    from syncless.report.data import load
    from syncless.run.store import RunStore

    with RunStore(run_dir) as store:
        data = load(store)
        # Per rank and report, which the bucketed curves of RunData do not keep.
        stragglers = sections_stragglers.sections(store) if data.steps else []
    return page(data, sections(data) + stragglers)


def page(data: RunData, parts: list[Section]) -> str:
    name = str(data.info.get("name") or Path(str(data.info.get("path", ""))).name)
    warn = ""
    if data.unreadable:
        items = "".join(f"<li>{html.escape(u)}</li>" for u in data.unreadable)
        warn = (
            f'<div class="warn">{len(data.unreadable)} shard(s) could not be read and '
            f"are left out of every number below:<ul>{items}</ul></div>"
        )
    alarm = ""
    if data.nonfinite:  # the first thing to read: it dates every chart below
        lines = "".join(f"<p>{html.escape(line)}</p>" for line in data.nonfinite.lines())
        alarm = f'<div class="alarm" id="nonfinite" role="alert">{lines}</div>'
    if not parts:
        warn += '<p class="note">The run recorded no metrics yet.</p>'
    return document(name, parts, alarm, warn)


def document(name: str, parts: list[Section], alarm: str = "", warn: str = "") -> str:
    """The page: ``alarm`` above the navigation, ``warn`` below it, then the sections.

    plotly.js (~4.8 MB) is inlined once: the file opens with no network. Every figure
    is written with include_plotlyjs=False and calls the global Plotly.
    """
    from plotly.offline import get_plotlyjs

    title = html.escape(name)
    nav = " ".join(f'<a href="#{s.anchor}">{html.escape(s.title)}</a>' for s in parts)
    body = "".join(
        f'<section id="{s.anchor}"><h2>{html.escape(s.title)}</h2>{s.body}</section>' for s in parts
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>syncless report: {title}</title><style>{CSS}</style>"
        f'<script type="text/javascript">{get_plotlyjs()}</script></head>'
        f"<body><h1>syncless report: {title}</h1>{alarm}<nav>{nav}</nav>{warn}{body}"
        f'<p class="note">Made by <code>syncless report</code> on '
        f"{time.strftime('%Y-%m-%d %H:%M')}.</p></body></html>\n"
    )


def write(run_dir: str | Path, output: str | Path | None = None) -> RunPath:
    """Write the report of ``run_dir`` (default ``RUN_DIR/report.html``, in an object
    store too); return its path."""
    path = run_path(output) if output else run_path(run_dir) / "report.html"
    return save(path, build(run_dir))


def save(path: RunPath, text: str) -> RunPath:
    """Write ``text`` to ``path`` whole (a local file or an object)."""
    try:
        write_whole(path, text.encode())
    except OSError as e:
        raise UsageError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    return path
