"""Step-time overhead of the built-in monitors on the demo, measured in one run.

For each phase (all monitors, each monitor alone, the naive implementation) the
monitors stay attached for a segment of steps and are switched on by the host cadence
in a period-4 pattern: off, off, ON, off. A monitored step's hooks land in its own
step time and its flush in the next step's (the demo times a step from one log point
to the next, and the flush runs after the log), so the cost of one monitored step is

    (t[ON] + t[ON+1]) - (t[ON-2] + t[ON-1])

relative to the two off steps before it. Pairs that are 2 steps apart cancel the
slow drift that made block-interleaved runs of the host-bound demo unreadable
(bench/RESULTS.md, 2026-11-30, d5df34f). The spread of the per-period estimates is
printed: an overhead inside it is not resolved by the run.

Attached-but-inactive hooks still run (they return at once): that cost is in every
step of a segment and so is not in the estimate; it is a few Python calls per layer.

Next to each overhead it prints the monitor's floor: the bytes it must read per
monitored step (floor_bytes) at the H200's measured copy bandwidth, as a share of the
off step (meaningful on the H200 only).

It also checks: zero syncs attributed to syncless.monitors (a census over one period
of the "all" phase) and exactly one D2H copy per flush.

    python bench/monitors_overhead.py --preset large --periods 12
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from naive_monitors import NaiveMonitors  # bench/ is on sys.path as a script
from results import append_result, metric_values

from syncless import kernels
from syncless.demo.config import preset
from syncless.demo.parallel import is_expert_param
from syncless.demo.tools import DemoContext
from syncless.demo.train import run_demo
from syncless.guard import census
from syncless.monitors import MONITORS, attach, build
from syncless.monitors.adapters import find_layers

PERIOD = 4
ON = 2  # position of the monitored step in the period


class OverheadBench:
    """A DemoTool: one segment per phase, monitors on at one step of each period."""

    name = "monitors-overhead"

    def __init__(self, phases: list[str], periods: int, warmup: int) -> None:
        self.phases, self.periods, self.warmup = phases, periods, warmup
        self.segment = periods * PERIOD
        self.handle = None
        self.naive: NaiveMonitors | None = None
        self.census_syncs: dict[str, int] = {}
        self.copies_ok = True
        self._census = None

    @property
    def total_steps(self) -> int:
        return self.warmup + len(self.phases) * self.segment

    def phase_at(self, step: int) -> str | None:
        if step < self.warmup:
            return None
        return self.phases[(step - self.warmup) // self.segment]

    def is_on(self, step: int) -> bool:
        return step >= self.warmup and (step - self.warmup) % PERIOD == ON

    def attach(self, ctx: DemoContext) -> None:
        self.ctx = ctx
        self.n_params = sum(p.numel() for p in ctx.model.parameters())

    def _start(self, phase: str) -> None:
        ctx = self.ctx
        if phase == "naive":
            self.naive = NaiveMonitors(find_layers(ctx.model))
            self.naive.active = False
            return
        names = list(MONITORS) if phase == "all" else [phase]
        sharded = is_expert_param if ctx.expert_parallel else None
        monitors = build(names, optimizer=ctx.optimizer, every=1, is_sharded=sharded)
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
        phase = self.phase_at(step)
        if phase is not None and (step - self.warmup) % self.segment == 0:
            self._stop()
            self._start(phase)
        on = self.is_on(step)
        if self.handle is not None:
            for m in self.handle.monitors:
                m.active = on
        if self.naive is not None:
            self.naive.active = on
        # one census over the first monitored period of the "all" phase
        first_all = (
            self.warmup + self.phases.index("all") * self.segment if "all" in self.phases else -1
        )
        if step == first_all:
            self._census = census().__enter__()

    def step_end(self, step: int) -> None:
        on = self.is_on(step)
        if self.handle is not None and on:
            self.handle.step(step)  # flush only after a monitored step
        if self.naive is not None and on:
            self.naive.norms(self.ctx.model)
        if self._census is not None and step % PERIOD == PERIOD - 1 and not on:
            self._census.step(step)
            self._census.__exit__(None, None, None)
            for (site, _op), n in self._census.by_site().items():
                self.census_syncs[site.display()] = self.census_syncs.get(site.display(), 0) + n
            self._census = None

    def close(self) -> None:
        self._stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--periods", type=int, default=12, help="monitored steps per phase")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--kernels", default="auto", choices=kernels.BACKENDS)
    parser.add_argument(
        "--phases", default=",".join(["all", *MONITORS, "naive"]), help="comma-separated"
    )
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    kernels.set_backend(args.kernels)

    phases = args.phases.split(",")
    tool = OverheadBench(phases, args.periods, args.warmup)
    cfg = preset(args.preset, steps=tool.total_steps, log_every=1)
    with tempfile.TemporaryDirectory() as tmp:
        result = run_demo(cfg, run_dir=Path(tmp) / "run", quiet=True, tools=[tool])
        t = metric_values(result.run_dir, "demo/step/step_ms")
    floors = floor_bytes(cfg, tool.n_params)

    rows = []
    off_steps = []
    for i, phase in enumerate(phases):
        start = args.warmup + i * tool.segment
        estimates = []
        for p in range(1, args.periods):  # the first period of a segment holds attach()
            on = start + p * PERIOD + ON
            base = t[on - 2] + t[on - 1]
            estimates.append(((t[on] + t[on + 1]) - base) / base * 100)
            off_steps += [t[on - 2], t[on - 1]]
        q = statistics.quantiles(estimates, n=4)
        rows.append((phase, statistics.median(estimates), q[0], q[2]))
    off_ms = statistics.median(off_steps)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # per-step cost of one monitored step; at the default cadences the stack costs
    # sum(cost_i / every_i): norms runs every 10 steps, the others every step.
    every = {m.name: m.every for m in build(list(MONITORS), optimizer=_DummyOpt())}
    stack = sum(pct / every[p] for p, pct, _, _ in rows if p in every)
    backend = args.kernels
    if backend == "auto":
        backend = "triton" if device == "cuda" and kernels.triton_importable() else "torch"
    print(f"\ndemo {args.preset} on {device}, {backend} kernels: off {off_ms:.1f} ms/step, {args.periods - 1} "
          "monitored steps per phase")  # fmt: skip

    def floor_pct(phase: str) -> float:
        nbytes = sum(floors.values()) if phase == "all" else floors.get(phase, 0.0)
        return nbytes / HBM_BYTES_PER_S * 1e3 / off_ms * 100

    print(f"{'phase':<14}{'overhead':>10}{'IQR':>20}{'HBM floor':>12}")
    for phase, pct, lo, hi in rows:
        floor = f"{floor_pct(phase):.3f}%" if phase != "naive" else ""
        print(f"{phase:<14}{pct:>+9.2f}%{lo:>+11.2f}%..{hi:+.2f}%{floor:>12}")
    print(f"stack at default cadences (sum of each monitor's cost / every): {stack:+.2f}%")
    monitor_syncs = {k: v for k, v in tool.census_syncs.items() if "monitors" in k}
    print(f"syncs in syncless.monitors during the census period: {sum(monitor_syncs.values())}")
    print(f"one D2H copy per flush: {tool.copies_ok}")

    if not args.no_record:
        table = "; ".join(
            f"{p} {pct:+.2f}% (IQR {lo:+.1f}..{hi:+.1f}, floor {floor_pct(p):.3f}%)"
            for p, pct, lo, hi in rows
        )
        append_result(
            "monitors_overhead",
            f"demo {args.preset}, {backend} kernels, off {off_ms:.1f} ms/step; per monitored step vs the 2 off steps "
            f"before it ({args.periods - 1} periods/phase): {table}; stack at default cadences "
            f"{stack:+.2f}%; monitor syncs {sum(monitor_syncs.values())}; "
            f"1 D2H/flush {tool.copies_ok}",
        )


# Device-to-device copy bandwidth (reads + writes) measured on an H200 with torch 2.11
# (shared/NOTES.md, 2026-11-30): the rate a monitor's unavoidable bytes move at best.
HBM_BYTES_PER_S = 4.3e12


def floor_bytes(cfg, n_params: int) -> dict[str, float]:
    """Bytes each monitor must read per monitored step, at the least.

    activations / nonfinite: each layer's output once (fp32 residual stream). attention:
    q and k once (bf16 on CUDA). moe: the router logits (fp32). norms: every parameter
    and gradient (fp32) for the norms, plus the snapshot copy (read + write) and the
    update pass (two reads) for the update ratio.
    """
    tokens = cfg.batch_size * cfg.seq_len
    act = cfg.n_layers * tokens * cfg.d_model * 4
    return {
        "activations": act,
        "nonfinite": act,
        "attention": cfg.n_layers * tokens * 2 * cfg.d_model * 2,
        "moe": cfg.n_layers * tokens * cfg.n_experts * 4,
        "norms": n_params * 4 * (2 + 2 + 2),
    }


class _DummyOpt(torch.optim.SGD):
    def __init__(self) -> None:
        super().__init__([torch.zeros(1, requires_grad=True)], lr=0.0)


if __name__ == "__main__":
    main()
