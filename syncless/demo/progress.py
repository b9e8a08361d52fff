"""The demo's progress: a live bar and table on a terminal, plain lines in a log.

Both are Sinks like any other, so what they show is exactly what lands in the run store.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from syncless.run import StepRecord

COLUMNS = {
    "demo/step/loss": ("loss", "{:.4f}"),
    "demo/step/tokens_per_s": ("tokens/s", "{:,.0f}"),
    "demo/step/mfu_frac": ("MFU", "{:.1%}"),  # on a GPU of known peak (the title names it)
    "demo/step/step_ms": ("step ms", "{:.1f}"),
}


def progress_view(
    total_steps: int, title: str, console: Console, first_step: int = 0
) -> LiveView | ProgressLines:
    """The live view on a terminal; elsewhere (a file, a pipe) plain lines as it goes."""
    if console.is_terminal:
        return LiveView(total_steps, title, console, first_step)
    return ProgressLines(total_steps, title, console, first_step)


# The lead rank's record of the slowest rank per section with an open straggler verdict
# (syncless.profile.report.straggler_values); a profiler report always has the step row.
_STRAGGLER = re.compile(r"profile/(.+)/straggler_rank(_score|_first_step)?")
_REPORT = "profile/step/time_ms"


def straggler_line(records: Sequence[StepRecord]) -> str | None:
    """The open straggler verdicts of the latest profiler report in ``records``, as one
    line (slowest first); "" when that report named nobody; None without a report."""
    latest = max((r.step for r in records if r.name == _REPORT), default=None)
    if latest is None:
        return None
    found: dict[str, dict[str, float]] = {}
    for r in records:
        match = _STRAGGLER.fullmatch(r.name)
        if match and r.step == latest:
            found.setdefault(match.group(1), {})[match.group(2) or "rank"] = r.value
    parts = [
        f"rank {v['rank']:.0f} slow in {section} (score {v.get('_score', float('nan')):.2f}, "
        f"since step {v.get('_first_step', latest):.0f})"
        for section, v in sorted(found.items(), key=lambda kv: kv[1].get("_score", 1.0))
        if "rank" in v
    ]
    return "stragglers: " + "; ".join(parts) if parts else ""


def _latest(records: Sequence[StepRecord]) -> dict[int, dict[str, float]]:
    """The shown columns of ``records``, by step."""
    steps: dict[int, dict[str, float]] = {}
    for r in records:
        if r.name in COLUMNS:
            steps.setdefault(r.step, {})[r.name] = r.value
    return steps


class LiveView:
    """A progress bar and a table of the last 8 logged steps, redrawn in place."""

    def __init__(
        self, total_steps: int, title: str, console: Console | None = None, first_step: int = 0
    ) -> None:
        self.console = console or Console(stderr=True)
        self.title = title
        self.first_step = first_step
        self.rows: deque[tuple[int, dict[str, float]]] = deque(maxlen=8)
        self.stragglers = ""  # the latest profiler report's verdicts, as a line
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
        if self.stragglers:
            return Group(self.progress, table, Text(self.stragglers, style="bold red"))
        return Group(self.progress, table)

    def write(self, records: Sequence[StepRecord]) -> None:
        line = straggler_line(records)
        if line is not None and line != self.stragglers:
            self.stragglers = line
            self.live.update(self._render())
        steps = _latest(records)
        if not steps:
            return
        for step in sorted(steps):
            self.rows.append((step, steps[step]))
        self.progress.update(self.task, completed=max(steps) + 1 - self.first_step)
        self.live.update(self._render())

    def close(self) -> None:
        self.live.update(self._render())
        self.live.stop()
        if not self.console.is_terminal:
            self.console.line()  # rich leaves a non-terminal stream mid-line


class ProgressLines:
    """One plain line per ``every_s`` seconds of logged steps, flushed: for a log file,
    where a live view would print nothing until the run ends.

    Example line::

        syncless demo (cpu, 1 rank(s)): step 120 (121/200)  loss 2.4512  tokens/s 61,204  step ms 8.4  (5.0 s)

    and, when the profiler's straggler verdicts change, a line of their own::

        syncless demo (cpu, 4 rank(s)): stragglers: rank 2 slow in backward (score 0.31, since step 0)

    and on a GPU whose peak is known (the title names it)::

        syncless demo (cuda, 1 rank(s), peak 989 TFLOP/s bf16): step 60 (61/120)  loss 1.8710  tokens/s 97,312  MFU 39.7%  step ms 252.5  (21.3 s)
    """

    def __init__(
        self,
        total_steps: int,
        title: str,
        console: Console,
        first_step: int = 0,
        every_s: float = 5.0,
    ) -> None:
        self.console = console
        self.title = title
        self.first_step = first_step
        self.total_steps = total_steps
        self.last = first_step + total_steps - 1
        self.every_s = every_s
        self.start = time.monotonic()
        self._printed_at: float | None = None  # None: print the first logged step
        self._unprinted: tuple[int, dict[str, float]] | None = None
        self.stragglers = ""  # the verdicts printed last

    def write(self, records: Sequence[StepRecord]) -> None:
        line = straggler_line(records)
        if line is not None and line != self.stragglers:  # printed when they change
            self.stragglers = line
            if not self.console.quiet:
                text = line or "stragglers: none now"
                print(f"{self.title}: {text}", file=self.console.file, flush=True)
        steps = _latest(records)
        if not steps:
            return
        step = max(steps)
        self._unprinted = (step, steps[step])
        now = time.monotonic()
        if self._printed_at is None or now - self._printed_at >= self.every_s or step == self.last:
            self._print(now)

    def _print(self, now: float) -> None:
        if self._unprinted is None or self.console.quiet:
            return
        step, values = self._unprinted
        self._unprinted, self._printed_at = None, now
        cells = "  ".join(
            f"{header} {fmt.format(values[k])}"
            for k, (header, fmt) in COLUMNS.items()
            if k in values
        )
        done = f"{step + 1 - self.first_step}/{self.total_steps}"
        line = f"{self.title}: step {step} ({done})  {cells}  ({now - self.start:.1f} s)"
        print(line, file=self.console.file, flush=True)

    def close(self) -> None:
        self._print(time.monotonic())  # the last logged step, if not shown yet
