"""``syncless demo --monitors all|attention,moe,...``: the built-in monitors on the demo."""

from __future__ import annotations

from syncless.demo.parallel import is_expert_param
from syncless.demo.tools import DemoContext
from syncless.monitors import MonitorHandle, attach, build


class MonitorsTool:
    name = "monitors"

    def __init__(self, names: str, every: int | None = None, budget: float | None = None) -> None:
        self.names = names
        self.every = every
        self.budget = budget
        self.handle: MonitorHandle | None = None
        self.ctx: DemoContext | None = None

    def attach(self, ctx: DemoContext) -> None:
        self.ctx = ctx
        monitors = build(
            self.names,
            optimizer=ctx.optimizer,
            every=self.every,
            is_sharded=is_expert_param if ctx.expert_parallel else None,
        )
        self.handle = attach(ctx.model, monitors, run=ctx.run, budget=self.budget)

    def step_begin(self, step: int) -> None:
        pass

    def step_enqueued(self, step: int) -> None:
        # Before the loss read-back: the flush is lagged (it reads the previous step's
        # copy), so its host work overlaps the device's backward and optimizer tail.
        assert self.handle is not None and self.ctx is not None
        if self.handle.nonfinite is not None:  # the alarm checks the loss and grad norm
            self.handle.step(step, **self.ctx.checked)
        else:
            self.handle.step(step)

    def step_end(self, step: int) -> None:
        pass

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
