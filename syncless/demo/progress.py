"""The demo's live view: a progress bar and a compact table of recent steps.

It is a Sink like any other, so what it shows is exactly what lands in the run store.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from syncless.run import StepRecord

COLUMNS = {
    "demo/step/loss": ("loss", "{:.4f}"),
    "demo/step/tokens_per_s": ("tokens/s", "{:,.0f}"),
    "demo/step/step_ms": ("step ms", "{:.1f}"),
}


class LiveView:
    def __init__(self, total_steps: int, title: str, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.title = title
        self.rows: deque[tuple[int, dict[str, float]]] = deque(maxlen=8)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task(title, total=total_steps)
        self.live = Live(self._render(), console=self.console, refresh_per_second=4)
        self.live.start()

    def _render(self) -> Group:
        table = Table(box=None, pad_edge=False, header_style="bold")
        table.add_column("step", justify="right")
        for header, _ in COLUMNS.values():
            table.add_column(header, justify="right")
        for step, values in self.rows:
            cells = [
                fmt.format(values[k]) if k in values else "-" for k, (_, fmt) in COLUMNS.items()
            ]
            table.add_row(str(step), *cells)
        return Group(self.progress, table)

    def write(self, records: Sequence[StepRecord]) -> None:
        steps: dict[int, dict[str, float]] = {}
        for r in records:
            if r.name in COLUMNS:
                steps.setdefault(r.step, {})[r.name] = r.value
        if not steps:
            return
        for step in sorted(steps):
            self.rows.append((step, steps[step]))
        self.progress.update(self.task, completed=max(steps) + 1)
        self.live.update(self._render())

    def close(self) -> None:
        self.live.update(self._render())
        self.live.stop()
        if not self.console.is_terminal:
            self.console.line()  # rich leaves a non-terminal stream mid-line
