"""``census()``: count, per call site and per step, what would sync on a GPU."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType

from rich.console import Console
from rich.table import Table

from syncless.guard import _cuda, _session
from syncless.guard._sites import Site
from syncless.run.console import print_wide
from syncless.run.records import StepRecord, check_metric_name

STEP_METRIC = "guard/step/syncs_count"
SITE_METRIC = "guard/site/{key}/syncs_count"

BLIND_SPOTS = (
    "Not counted: syncs inside C++ code and extensions that do not pass through torch's "
    "Python dispatch (custom kernels, cuBLAS/cuDNN internals), torch.distributed calls "
    "and their waits, torch.cuda.synchronize(), Event/Stream.synchronize(), and blocking "
    "copy_() into host tensors on a CPU build."
)


@dataclass
class _Step:
    number: int
    time: float
    counts: Counter[tuple[Site, str]] = field(default_factory=Counter)


class Census:
    """Counts would-be syncs instead of raising. Use as ``with census() as c:``.

    The detected operation still runs. Counts go to the open step; ``step()`` closes
    it. One user action counts once (``.item()`` is ``Tensor.item``, not also
    ``aten._local_scalar_dense``). Inside or around ``no_sync()`` the census counts
    every sync it sees, including the one the guard then raises on.
    """

    def __init__(self, *, cpu_as_device: bool | None = None, start_step: int = 0) -> None:
        self.cpu_as_device = (
            (not _cuda.cuda_available()) if cpu_as_device is None else cpu_as_device
        )
        self._lock = threading.Lock()
        self._closed: list[_Step] = []
        self._open = _Step(start_step, 0.0)
        self._active: tuple[_session.Session, _session.CountFrame] | None = None

    # -- context -----------------------------------------------------------------

    def __enter__(self) -> Census:
        if self._active is not None:
            raise RuntimeError("this census is already active; enter it once at a time")
        frame = _session.CountFrame(self, self.cpu_as_device)
        self._active = (_session.enter(frame), frame)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._active is None:
            raise RuntimeError("census exited without being entered")
        session, frame = self._active
        self._active = None
        try:
            _session.leave(session, frame)
        finally:
            # A trailing step() leaves an empty open step: that is not a step.
            with self._lock:
                if self._open.counts or not self._closed:
                    self._close_open(None)

    def _count(self, op: str, site: Site) -> None:
        with self._lock:
            self._open.counts[(site, op)] += 1

    # -- steps -------------------------------------------------------------------

    def step(self, n: int | None = None) -> int:
        """Close the open step (numbered ``n`` if given) and return its sync count.

        The next step is numbered one more than the step just closed.
        """
        with self._lock:
            return self._close_open(n)

    def _close_open(self, n: int | None) -> int:
        closing = self._open
        if n is not None:
            closing.number = n
        closing.time = time.time()
        self._closed.append(closing)
        self._open = _Step(closing.number + 1, 0.0)
        return sum(closing.counts.values())

    def _steps(self) -> list[_Step]:
        with self._lock:
            steps = list(self._closed)
            if self._open.counts:
                steps.append(_Step(self._open.number, time.time(), Counter(self._open.counts)))
        return steps

    # -- results -----------------------------------------------------------------

    @property
    def total(self) -> int:
        """All syncs counted so far."""
        return sum(sum(s.counts.values()) for s in self._steps())

    def by_site(self) -> dict[tuple[Site, str], int]:
        """``{(site, op): count}``, most frequent first (ties by site)."""
        totals: Counter[tuple[Site, str]] = Counter()
        for s in self._steps():
            totals.update(s.counts)
        return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))

    def by_op(self) -> dict[str, int]:
        """``{op: count}``, most frequent first."""
        totals: Counter[str] = Counter()
        for (_, op), count in self.by_site().items():
            totals[op] += count
        return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))

    def per_step(self) -> dict[int, int]:
        """``{step: count}`` for the closed steps (and the open one if it counted any)."""
        result: dict[int, int] = {}
        for s in self._steps():
            result[s.number] = result.get(s.number, 0) + sum(s.counts.values())
        return result

    def records(self, run: str, rank: int) -> list[StepRecord]:
        """Step records for the run store.

        Per step: ``guard/step/syncs_count`` (always, even when 0), and for each site
        that synced in that step ``guard/site/<module>.<line>.<function>/syncs_count``
        (summed over ops; see ``Site.metric_key``).
        """
        out: list[StepRecord] = []
        for s in self._steps():
            out.append(
                StepRecord(run, s.number, rank, STEP_METRIC, float(sum(s.counts.values())), s.time)
            )
            per_site: Counter[str] = Counter()
            for (site, _), count in s.counts.items():
                per_site[site.metric_key()] += count
            for key, count in sorted(per_site.items()):
                name = check_metric_name(SITE_METRIC.format(key=key))
                out.append(StepRecord(run, s.number, rank, name, float(count), s.time))
        return out

    def print_table(self, console: Console | None = None) -> None:
        """Print the census as a rich table, most frequent first, with its blind spots."""
        steps = max(len(self._steps()), 1)
        table = Table(
            title=f"sync census: {self.total} syncs in {steps} step(s)",
        )
        table.add_column("site")
        table.add_column("function")
        table.add_column("op")
        table.add_column("count", justify="right")
        table.add_column("per step", justify="right")
        for (site, op), count in self.by_site().items():
            table.add_row(
                site.display(),
                site.function,
                op,
                str(count),
                f"{count / steps:.2f}",
            )
        console = console or Console()
        print_wide(console, table)
        console.print(BLIND_SPOTS, style="dim")


def census(*, cpu_as_device: bool | None = None, start_step: int = 0) -> Census:
    """Count, instead of raise on, everything ``no_sync()`` would flag.

    Use as ``with census() as c:``; call ``c.step()`` at the end of each training step
    (or ``c.step(n)`` to number it). Counts are per call site (the first frame outside
    torch and syncless.guard), per operation and per step. ``cpu_as_device`` is as in
    ``no_sync()``. It does not touch CUDA's sync debug mode.
    """
    return Census(cpu_as_device=cpu_as_device, start_step=start_step)
