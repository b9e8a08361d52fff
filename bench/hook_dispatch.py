"""Host cost of timing a module: torch's forward-hook dispatch against a forward wrapper.

Per call of an identity module: the plain call, the call with two empty hooks (torch's
hook dispatch alone: what timing a module by a forward-pre-hook and a forward hook
pays before its hooks do anything), with ``Profiler.hook_module`` (a wrapped forward;
it was two hooks at the first line in bench/RESULTS.md), and with a bare wrapper frame around ``forward``
that reads the clock twice.

``--cold`` times each call alone after reading 64 MiB (more than the host's caches),
as inside a training step, where milliseconds of other Python and torch work run
between two calls of a module: the same calls then cost several times more.

    python bench/hook_dispatch.py [--cold]   # any device: it is host time
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from results import append_result  # bench/ is on sys.path as a script
from torch import nn

from syncless.profile import Profiler


class Identity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def warm_call_us(module: nn.Module, x: torch.Tensor, n: int = 20000, repeats: int = 5) -> float:
    """Median over ``repeats`` of the host time of one call."""
    for _ in range(500):
        module(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(n):
            module(x)
        times.append((time.perf_counter_ns() - start) / n / 1e3)
    return statistics.median(times)


_EVICT = np.ones(64 * 2**20 // 8)


def cold_call_us(module: nn.Module, x: torch.Tensor, n: int = 3000) -> float:
    """Median host time of one call made right after reading 64 MiB."""
    times = []
    for _ in range(n):
        _EVICT.sum()
        start = time.perf_counter_ns()
        module(x)
        times.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cold", action="store_true", help="each call after evicting caches")
    args = parser.parse_args()
    per_call_us = cold_call_us if args.cold else warm_call_us
    x = torch.zeros(1)
    plain = per_call_us(Identity(), x)

    hooked = Identity()
    hooked.register_forward_pre_hook(lambda module, args: None)
    hooked.register_forward_hook(lambda module, args, output: None)
    empty_hooks = per_call_us(hooked, x)

    profiled = Identity()
    prof = Profiler(mode="events", report_every=10**9)  # the host clock without CUDA
    prof.hook_module(profiled, "identity")
    prof.begin_step(0)
    profiler_hooks = per_call_us(profiled, x)
    prof.end_step()

    wrapped = Identity()
    inner, clock = wrapped.forward, time.perf_counter_ns

    def forward(*args, **kwargs):
        start = clock()
        out = inner(*args, **kwargs)
        clock() - start
        return out

    wrapped.forward = forward  # type: ignore[method-assign]
    wrapper = per_call_us(wrapped, x)
    how = "each call after reading 64 MiB, median of 3000" if args.cold else "median of 5 x 20000"
    line = (
        f"host us per call of an identity module ({how}): plain {plain:.2f}; "
        f"two empty hooks {empty_hooks:.2f}; the profiler's hook_module {profiler_hooks:.2f}; "
        f"a forward wrapper reading the clock twice {wrapper:.2f}"
    )
    print(line)
    append_result("hook_dispatch", line)


if __name__ == "__main__":
    main()
