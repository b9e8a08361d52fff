"""Step-time overhead of the built-in monitors on the demo, interleaved in one run.

One demo run alternates blocks of steps between phases: monitors off, all monitors at
their default cadences, each monitor alone at every step, and a naive implementation
of the same statistics (`.item()` per statistic, one all_reduce per metric). Each
phase's median step time is compared with the median of the "off" blocks around it,
so drift over the run cancels. The first `skip` steps of every block are dropped
(attach and the first flush land there).

It also checks, on the same run: zero syncs attributed to syncless.monitors (a census
over two monitored steps) and exactly one D2H copy per flush.

    python bench/monitors_overhead.py --preset large --steps-per-block 6 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from naive_monitors import NaiveMonitors  # bench/ is on sys.path as a script
from results import append_result, metric_values

from syncless.demo.config import preset
from syncless.demo.parallel import is_expert_param
from syncless.demo.tools import DemoContext
from syncless.demo.train import run_demo
from syncless.guard import census
from syncless.monitors import MONITORS, attach, build
from syncless.monitors.adapters import find_layers


class OverheadBench:
    """A DemoTool that switches phases at block boundaries."""

    name = "monitors-overhead"

    def __init__(self, schedule: list[str], block: int) -> None:
        self.schedule, self.block = schedule, block
        self.phase_of_step: dict[int, str] = {}
        self.handle = None
        self.naive: NaiveMonitors | None = None
        self.census_syncs: dict[str, int] = {}
        self.copies_ok = True

    def attach(self, ctx: DemoContext) -> None:
        self.ctx = ctx

    def _start(self, phase: str) -> None:
        ctx = self.ctx
        if phase == "off":
            return
        if phase == "naive":
            self.naive = NaiveMonitors(find_layers(ctx.model))
            return
        names = list(MONITORS) if phase in ("all", "census") else [phase]
        every = None if phase in ("all", "census") else 1
        sharded = is_expert_param if ctx.expert_parallel else None
        monitors = build(names, optimizer=ctx.optimizer, every=every, is_sharded=sharded)
        self.handle = attach(ctx.model, monitors, run=ctx.run)

    def _stop(self) -> None:
        if self.handle is not None:
            m = self.handle.metrics
            self.handle.close()
            self.copies_ok &= m.d2h_copies == m.flushes
            self.handle = None
        if self.naive is not None:
            self.naive.close()
            self.naive = None

    def step_begin(self, step: int) -> None:
        phase = self.schedule[(step // self.block) % len(self.schedule)]
        if step % self.block == 0:
            self._stop()
            self._start(phase)
            if phase == "census":
                self._census = census().__enter__()
        self.phase_of_step[step] = phase

    def step_end(self, step: int) -> None:
        if self.handle is not None:
            self.handle.step(step)
        if self.naive is not None:
            self._naive_norms()
        if self.phase_of_step[step] == "census":
            self._census.step(step)
            if step % self.block == self.block - 1:
                self._census.__exit__(None, None, None)
                for (site, _op), n in self._census.by_site().items():
                    key = site.display()
                    self.census_syncs[key] = self.census_syncs.get(key, 0) + n

    def _naive_norms(self) -> None:
        for name, p in self.ctx.model.named_parameters():
            self.naive.values[f"{name}/norm"] = p.norm().item()
            if p.grad is not None:
                self.naive.values[f"{name}/grad_norm"] = p.grad.norm().item()

    def close(self) -> None:
        self._stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps-per-block", type=int, default=6)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    phases = ["all", *MONITORS, "naive"]
    schedule = []
    for p in phases:
        schedule += ["off", p]
    schedule += ["off", "census"]
    steps = len(schedule) * args.steps_per_block * args.rounds
    tool = OverheadBench(schedule, args.steps_per_block)
    cfg = preset(args.preset, steps=steps, log_every=1)
    with tempfile.TemporaryDirectory() as tmp:
        result = run_demo(cfg, run_dir=Path(tmp) / "run", quiet=True, tools=[tool])
        times = metric_values(result.run_dir, "demo/step/step_ms")

    by_block: list[tuple[str, float]] = []
    for b in range(steps // args.steps_per_block):
        first = b * args.steps_per_block + args.skip
        last = (b + 1) * args.steps_per_block
        by_block.append((tool.phase_of_step[first], statistics.median(times[first:last])))

    rows = []
    for phase in phases:
        ratios, ms = [], []
        for i, (p, t) in enumerate(by_block):
            if p == phase and i > 0 and i + 1 < len(by_block):
                off = statistics.mean([by_block[i - 1][1], by_block[i + 1][1]])
                ratios.append(t / off)
                ms.append(t)
        pct = [(r - 1) * 100 for r in ratios]
        rows.append((phase, statistics.median(ms), statistics.median(pct), min(pct), max(pct)))
    off_ms = statistics.median(t for p, t in by_block if p == "off")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"\ndemo {args.preset} on {device}: off {off_ms:.1f} ms/step")
    # The spread over blocks is the noise floor of this measurement: an overhead inside
    # it is not resolved by this run.
    print(f"{'phase':<14}{'ms/step':>10}{'overhead':>10}{'blocks min..max':>22}")
    for phase, ms, pct, lo, hi in rows:
        print(f"{phase:<14}{ms:>10.1f}{pct:>+9.2f}%{lo:>+12.1f}%..{hi:+.1f}%")
    monitor_syncs = {k: v for k, v in tool.census_syncs.items() if "monitors" in k}
    print(
        f"syncs in syncless.monitors during the census blocks: {sum(monitor_syncs.values())} {monitor_syncs}"
    )
    print(f"one D2H copy per flush: {tool.copies_ok}")

    if not args.no_record:
        table = "; ".join(f"{p} {pct:+.2f}% ({lo:+.1f}..{hi:+.1f})" for p, _, pct, lo, hi in rows)
        append_result(
            "monitors_overhead",
            f"demo {args.preset} off {off_ms:.1f} ms/step; overhead vs off "
            f"(interleaved, {args.rounds} rounds x {args.steps_per_block}-step blocks): {table}; "
            f"monitor syncs {sum(monitor_syncs.values())}; 1 D2H/flush {tool.copies_ok}",
        )


if __name__ == "__main__":
    main()
