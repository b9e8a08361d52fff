"""Section profiler overhead on the demo, per mode, against off, in one run.

The profiler is switched per step in a repeating cycle (off, events, off, sync, off,
megatron): each profiled step is compared with the mean of the off steps on both sides,
so drift cancels. "megatron" is a synchronize-per-span timer in the style of
Megatron-LM's timers (torch.cuda.synchronize() at every start and stop, host clock),
the comparison the issue asks for. Sections are the demo's (`syncless demo --profile`):
loop phases, per-module sections in the forward, and under expert parallelism the
dispatch collectives.

    python bench/profile_overhead.py --preset large --cycles 12
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from results import append_result, metric_values  # bench/ is on sys.path as a script
from torch import nn

from syncless.demo.config import preset
from syncless.demo.model import Attention, Experts, Router
from syncless.demo.tools import DemoContext
from syncless.demo.train import run_demo
from syncless.profile import OFF, Profiler

CYCLE = ["off", "events", "off", "sync", "off", "megatron"]


class MegatronTimers:
    """Synchronize at every span start and stop, then read the host clock."""

    mode = "megatron"

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._open: dict[str, float] = {}

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def begin_section(self, name: str, category: str = "compute", bytes: int = 0) -> None:
        self._sync()
        self._open[name] = time.perf_counter()

    def end_section(self, name: str) -> None:
        self._sync()
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - self._open.pop(name)

    def section(self, name: str, category: str = "compute", bytes: int = 0):
        timers = self

        class _Span:
            def __enter__(self):
                timers.begin_section(name)

            def __exit__(self, *exc):
                timers.end_section(name)

        return _Span()

    def begin_step(self, step: int) -> None:
        pass

    def end_step(self) -> None:
        pass


class SwitchingTool:
    name = "profile-overhead"

    def __init__(self) -> None:
        self.handles: list = []
        self.phase_of_step: dict[int, str] = {}

    def attach(self, ctx: DemoContext) -> None:
        self.ctx = ctx
        self.profilers = {
            "off": OFF,
            "events": Profiler(mode="events", report_every=10**9, console=ctx.console),
            "sync": Profiler(mode="sync", report_every=10**9, console=ctx.console),
            "megatron": MegatronTimers(),
        }
        names = {Attention: "attention", Router: "router", Experts: "experts"}
        for module in ctx.model.modules():
            if type(module) in names:
                self._hook(module, names[type(module)])

    def _hook(self, module: nn.Module, name: str) -> None:
        def begin(_m, _a):
            self.ctx.profiler.begin_section(name)

        def end(_m, _a, _o):
            self.ctx.profiler.end_section(name)

        self.handles += [module.register_forward_pre_hook(begin), module.register_forward_hook(end)]

    def step_begin(self, step: int) -> None:
        phase = CYCLE[step % len(CYCLE)]
        self.phase_of_step[step] = phase
        self.ctx.profiler = self.profilers[phase]
        self.ctx.profiler.begin_step(step)

    def step_end(self, step: int) -> None:
        self.ctx.profiler.end_step()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--cycles", type=int, default=12)
    parser.add_argument("--warmup-cycles", type=int, default=2)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    tool = SwitchingTool()
    steps = (args.cycles + args.warmup_cycles) * len(CYCLE) + 1
    cfg = preset(args.preset, steps=steps, log_every=1)
    with tempfile.TemporaryDirectory() as tmp:
        result = run_demo(cfg, run_dir=Path(tmp) / "run", quiet=True, tools=[tool])
        t = metric_values(result.run_dir, "demo/step/step_ms")

    # A step's measured time also holds the previous step's end_step (the demo times
    # from log to log), so a profiled step s is charged t[s] + t[s + 1] - 2 * off.
    first = args.warmup_cycles * len(CYCLE)
    est: dict[str, list[float]] = {"events": [], "sync": [], "megatron": []}
    off = []
    for s in range(first, steps - 2):
        phase = tool.phase_of_step[s]
        if phase == "off":
            off.append(t[s])
            continue
        base = (t[s - 1] + t[s + 2]) / 2  # the off steps around the profiled pair
        est[phase].append(((t[s] + t[s + 1]) - 2 * base) / base * 100)
    off_ms = statistics.median(off)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"\ndemo {args.preset} on {device}: off {off_ms:.1f} ms/step, {args.cycles} cycles")
    rows = []
    for mode, values in est.items():
        q = statistics.quantiles(values, n=4)
        rows.append((mode, statistics.median(values), q[0], q[2]))
        print(f"{mode:<10}{rows[-1][1]:>+9.2f}%   IQR {q[0]:+.2f}%..{q[2]:+.2f}%")
    if not args.no_record:
        table = "; ".join(f"{m} {p:+.2f}% (IQR {lo:+.1f}..{hi:+.1f})" for m, p, lo, hi in rows)
        append_result(
            "profile_overhead",
            f"demo {args.preset} off {off_ms:.1f} ms/step; profiled step vs off neighbours "
            f"({args.cycles} cycles): {table}",
        )


if __name__ == "__main__":
    main()
