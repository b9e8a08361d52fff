"""``syncless demo --profile MODE``: the section profiler on the demo.

Sections: the training loop's phases (data, forward, backward, grad_sync, optimizer,
log) and, inside forward, every attention, router, expert and shared-expert module
(forward hooks; backward is one section). Under ``--expert-parallel`` each dispatch
collective (counts exchange, token dispatch and combine, and their backward) goes
through ``Profiler.collective``: enqueue, rendezvous wait and transfer apart.
"""

from __future__ import annotations

from torch import nn

from syncless.demo.dispatch import AllToAllDispatcher
from syncless.demo.model import Attention, Experts, MoE, Router
from syncless.demo.tools import DemoContext
from syncless.profile import Profiler

SECTIONS: dict[type, str] = {Attention: "attention", Router: "router", Experts: "experts"}


class ProfileTool:
    name = "profile"

    def __init__(self, mode: str, report_every: int = 10) -> None:
        self.mode = mode
        self.report_every = report_every
        self.handles: list = []

    def attach(self, ctx: DemoContext) -> None:
        self.ctx = ctx
        self.prof = Profiler(mode=self.mode, report_every=self.report_every, run_name=ctx.run.name,
                             console=ctx.console)  # fmt: skip
        ctx.profiler = self.prof
        for module in ctx.model.modules():
            name = SECTIONS.get(type(module))
            if name is None and isinstance(module, MoE) and module.shared_expert is not None:
                self._hook(module.shared_expert, "shared_expert")
            if name is not None:
                self._hook(module, name)
            if isinstance(module, MoE) and isinstance(module.dispatcher, AllToAllDispatcher):
                module.dispatcher.comm = self.prof.collective

    def _hook(self, module: nn.Module, name: str) -> None:
        prof = self.prof

        def begin(_module, _args):
            prof.begin_section(name)

        def end(_module, _args, _out):
            prof.end_section(name)

        self.handles += [module.register_forward_pre_hook(begin), module.register_forward_hook(end)]

    def step_begin(self, step: int) -> None:
        self.prof.begin_step(step)

    def step_end(self, step: int) -> None:
        self.prof.end_step()
        report = self.prof.report(step, print_table=self.ctx.run.ranks.is_main)
        if report is not None:
            self.ctx.run.emit(report)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
