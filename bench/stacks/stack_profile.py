"""Where the monitor stack's cost goes on a GPU-bound step: device time per kernel, on
and off (issue 19).

bench/stacks/real_models.py measures the stack's overhead as a ratio of step times; on
Mixtral it measured about 0.4% of the step more than the budget's own estimate of
itself. This profiles ``--steps`` steps with the stack (one handle, its budget settled
over ``--warmup`` steps, so the steps cover its cadences) and as many with the handle
paused, alternating blocks so drift hits both, and prints per kernel the device time
per step on and off, largest difference first, with the total against the stack's own
``monitors/self/*`` estimate and the step's wall time.

    python -m bench.stacks stack_profile --model mixtral
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.harness import append_result
from bench.stacks.hf_models import build_workload, model_specs, train_step
from bench.stacks.segments import attach_kwargs, monitor_step
from syncless.monitors import attach, build


def kernel_times(prof: profile) -> dict[str, float]:
    """Device microseconds per kernel name over the profiled steps."""
    out: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] += e.device_time
    return out


def run_steps(work, handle, step: int, steps: int, walls: list[float]) -> int:
    for _ in range(steps):
        s = step
        start = time.perf_counter()
        flush = (lambda s=s: monitor_step(handle, work, s)) if handle is not None else None
        train_step(work, flush=flush)
        walls.append(time.perf_counter() - start)
        step += 1
    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mixtral")
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--steps", type=int, default=24, help="profiled steps per mode")
    parser.add_argument("--budget", type=float, default=0.01)
    parser.add_argument("--monitors", default="all", help="all, or a comma list")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args(argv)

    work = build_workload(model_specs()[args.model], torch.device("cuda"))
    handle = attach(
        work.model,
        build(args.monitors, optimizer=work.optimizer),
        **attach_kwargs(args.budget),
    )
    step = 0
    for _ in range(args.warmup):
        s = step
        train_step(work, flush=lambda s=s: monitor_step(handle, work, s))
        step += 1
    # The handle cannot pause: the stack's steps come first, then it is closed and the
    # same number of steps run bare. Device time per kernel barely drifts between them.
    walls: dict[bool, list[float]] = {True: [], False: []}
    per: dict[bool, dict[str, float]] = {}
    for on in (True, False):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step = run_steps(work, handle if on else None, step, args.steps, walls[on])
        per[on] = defaultdict(float, kernel_times(prof))
        if on:
            budget = handle.budget
            selfcost = [sum(budget.share().values())] if budget is not None else []
            cadences = dict(handle.cadences)
            handle.close()
    n = args.steps
    names = set(per[True]) | set(per[False])
    diff = sorted(names, key=lambda k: -(per[True][k] - per[False][k]))
    total_on = sum(per[True].values()) / n / 1e3
    total_off = sum(per[False].values()) / n / 1e3
    wall_on, wall_off = statistics.median(walls[True]), statistics.median(walls[False])
    print(f"device ms/step: on {total_on:.2f}, off {total_off:.2f}; wall ms/step median: "
          f"on {wall_on * 1e3:.1f}, off {wall_off * 1e3:.1f}")  # fmt: skip
    top = []
    for name in diff[: args.top]:
        d = (per[True][name] - per[False][name]) / n / 1e3
        print(f"  {d:+8.3f} ms/step  on {per[True][name] / n / 1e3:8.3f}  {name[:100]}")
        top.append(f"{name[:60]} {d:+.3f}")
    print("cadences:", cadences)
    share = statistics.median(selfcost) if selfcost else float("nan")
    line = (
        f"{args.model}, monitors {args.monitors} (budget {args.budget:g}) vs paused, {n} profiled steps each "
        f"after {args.warmup} warm-up, then {n} bare: device time "
        f"{total_on:.2f} vs {total_off:.2f} ms/step ({(total_on / total_off - 1) * 100:+.2f}%), "
        f"wall median {wall_on * 1e3:.1f} vs {wall_off * 1e3:.1f} ms "
        f"({(wall_on / wall_off - 1) * 100:+.2f}%), the stack's own share estimate "
        f"{share * 100:.2f}%; largest device-time increases (ms/step): {'; '.join(top[:8])}"
    )
    print(line)
    if not args.no_append:
        append_result("stack_profile", line)
