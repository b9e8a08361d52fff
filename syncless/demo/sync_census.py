"""``syncless demo --sync-census N``: count every host sync in N steps of the demo."""

from __future__ import annotations

from syncless.demo.tools import DemoContext
from syncless.guard import Census, census


class SyncCensusTool:
    """Runs ``syncless.guard.census()`` around steps ``first .. first + steps - 1``,
    counted from the loop's first step (0, or where a resumed run goes on).

    The first step is skipped by default: it holds one-time work (optimizer state creation,
    lazy initialisation) that says little about the steady state. The census covers
    the whole step, including the loss read-back of a logged step, prints its table
    (rank 0) and sends its records to the run store (every rank).
    """

    name = "sync-census"

    def __init__(self, steps: int = 3, first: int = 1) -> None:
        if steps < 1:
            raise ValueError(f"--sync-census takes a positive number of steps, got {steps}")
        self.steps = steps
        self.first = first
        self.census: Census | None = None
        self.start: int | None = None  # the loop's first step
        self.done = False
        self.syncs_per_step = 0.0

    def attach(self, ctx: DemoContext) -> None:
        self.run = ctx.run
        self.console = ctx.console

    def step_begin(self, step: int) -> None:
        if self.start is None:
            self.start = step
        if step == self.start + self.first and not self.done:
            self.census = census(start_step=step).__enter__()

    def step_end(self, step: int) -> None:
        if self.census is None:
            return
        self.census.step(step)
        assert self.start is not None
        if step == self.start + self.first + self.steps - 1:
            self._finish()

    def close(self) -> None:
        if self.census is not None:  # the run ended inside the census window
            self._finish()

    def _finish(self) -> None:
        c, self.census = self.census, None
        assert c is not None
        c.__exit__(None, None, None)
        self.done = True
        self.syncs_per_step = c.total / max(1, len(c.per_step()))
        self.run.emit(c.records(self.run.name, self.run.ranks.rank))
        c.print_table(self.console)
