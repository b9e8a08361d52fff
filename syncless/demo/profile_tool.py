"""``syncless demo --profile MODE``: the section profiler on the demo.

Sections: the training loop's phases (data, forward, backward, grad_sync, optimizer,
log) and, inside forward, every attention, router, expert and shared-expert module
(forward hooks; backward is one section). Under ``--expert-parallel`` each dispatch
collective (counts exchange, token dispatch and combine, and their backward) goes
through ``Profiler.collective``: enqueue, rendezvous wait and transfer apart.

``--profile-trace`` (costly: trace a few steps, then turn it off) reports every step,
splits the dispatch collectives per layer (``moe_dispatch_l03``: the rendezvous wait of
each layer) and writes every router's expert ids per step to the run directory
(syncless.profile.routing_trace).
"""

from __future__ import annotations

from torch import nn

from syncless.demo.dispatch import AllToAllDispatcher
from syncless.demo.model import Attention, Experts, MoE, Router
from syncless.demo.tools import DemoContext
from syncless.profile import Profiler
from syncless.profile.routing_trace import RoutingTrace

SECTIONS: dict[type, str] = {Attention: "attention", Router: "router", Experts: "experts"}


class ProfileTool:
    name = "profile"

    def __init__(self, mode: str, report_every: int = 10, trace: bool = False) -> None:
        self.mode = mode
        # A trace reports every step: one gather per step, per-layer collective rows.
        self.report_every = 1 if trace else report_every
        self.trace = trace
        self.routing: RoutingTrace | None = None
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
        if self.trace:
            self.routing = RoutingTrace(ctx.run.dir, ctx.run.ranks.rank)
            for index, block in enumerate(ctx.model.layers):
                self._trace_layer(index, block.moe)

    def _trace_layer(self, index: int, moe: MoE) -> None:
        routing = self.routing
        dispatcher = moe.dispatcher
        label = f"_l{index:02d}"

        def name_collectives(_module, _args):
            if isinstance(dispatcher, AllToAllDispatcher):
                dispatcher.label = label  # per-layer rows: moe_dispatch_l03, ...

        def record_routing(_module, _args, out):
            routing.record(index, out[1])  # Router returns (weights, experts, probs)

        self.handles += [
            moe.register_forward_pre_hook(name_collectives),
            moe.router.register_forward_hook(record_routing),
        ]

    def _hook(self, module: nn.Module, name: str) -> None:
        self.handles += self.prof.hook_module(module, name)

    def step_begin(self, step: int) -> None:
        self.prof.begin_step(step)

    def step_end(self, step: int) -> None:
        self.prof.end_step()
        if self.routing is not None:
            self.routing.end_step(step)
        report = self.prof.report(step, print_table=self.ctx.run.ranks.is_main)
        if report is not None:
            self.ctx.run.emit(report)

    def close(self) -> None:
        if self.routing is not None:
            self.routing.close()
        for h in self.handles:
            h.remove()
        self.handles.clear()
