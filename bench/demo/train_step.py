"""The demo's training step in a tight loop: the workload of the overhead benchmarks.

The demo model and preset, bf16 autocast on CUDA, AdamW, clipping and the loss read
back each step, over one batch already on the device with a zero learning rate, so
every step does exactly the same work. Run through the demo itself (data loader, log
thread, changing batches and routing), off steps of the large preset ranged from 205
to 390 ms on the H200 (bench/RESULTS.md, fae1201 and d551bcf); the residual spread
here is the host's own (about +-15% between the 5th and 95th percentile on the
H200's host, dc2abca), which is why the benchmarks also print low-percentile ratios.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from syncless.demo.model import MoETransformer, init_weights
from syncless.demo.parallel import clip_grad_norm
from syncless.profile import OFF


class TrainStep:
    """The demo's training step on fixed device batches; returns after the loss read."""

    def __init__(self, cfg, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.model = MoETransformer(cfg).to(device)
        init_weights(self.model, cfg.seed)
        fused = {"fused": True} if device.type == "cuda" else {}
        # lr 0: AdamW does all its work but the weights, hence routing, never change.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.0, **fused)
        g = torch.Generator().manual_seed(cfg.seed)
        shape = (cfg.batch_size, cfg.seq_len + 1)
        self.batch = torch.randint(0, 256, shape, generator=g).to(device)
        self.bf16 = device.type == "cuda"
        self.profiler: Any = OFF  # a benchmark may switch profilers between steps

    def __call__(self, step: int, before_read: Callable[[], None] | None = None) -> float:
        """One step; ``before_read`` runs after the optimizer step is enqueued and before
        the loss read-back (where the demo flushes its monitors, so a lagged flush's host
        work overlaps the device's tail of the step)."""
        prof = self.profiler
        inputs, targets = self.batch[:, :-1], self.batch[:, 1:]
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)
        with prof.section("forward"), autocast:
            logits, balance = self.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        with prof.section("backward"):
            (loss + self.cfg.aux_loss_coef * balance).backward()
        with prof.section("optimizer"):
            clip_grad_norm(self.model, self.cfg.grad_clip, False)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if before_read is not None:
            before_read()
        with prof.section("log", category="sync"):
            return loss.item()  # the demo's one read-back per step


PERIOD = 4
ON = 2  # position of the measured (switched-on) step in each period: off, off, ON, off


def paired_estimates(times: list[float], costs: list[float] | None = None) -> list[float]:
    """Per period: cost (%) of the ON step and the step after it (which carries its
    lagged work) against the two off steps before it; pairs 2 steps apart cancel drift.

    ``costs`` (e.g. the training thread's CPU time per step): the same difference taken
    in it, still relative to the off steps' wall time."""
    costs = times if costs is None else costs
    out = []
    for p in range(len(times) // PERIOD):
        on = p * PERIOD + ON
        if on + 1 >= len(times):
            break
        base = times[on - 2] + times[on - 1]
        extra = (costs[on] + costs[on + 1]) - (costs[on - 2] + costs[on - 1])
        out.append(extra / base * 100)
    return out


def add_blocking_sync_flag(parser: argparse.ArgumentParser) -> None:
    """``--blocking-sync`` (see ``blocking_sync``); parse, then ``blocking_sync()`` if set."""
    parser.add_argument(
        "--blocking-sync",
        action="store_true",
        help="host waits for the GPU sleep instead of spin, so the training thread's CPU "
        "time (also printed) counts its work only (train_step.blocking_sync)",
    )


def blocking_sync(device: int = 0) -> bool:
    """Make host waits for this GPU sleep instead of spin (``CU_CTX_SCHED_BLOCKING_SYNC``
    on the primary context), so a thread's CPU time counts its work and not its waits.

    Why: the demo's step is host-bound, so what the monitors or the profiler add is host
    work; the training thread's CPU time measures it, with far less of the host's
    scheduling noise than wall time, but only if a ``.tolist()`` waiting for the GPU
    does not spin (CUDA spins by default when it has a core per context). Call before
    anything touches CUDA; the workload's wall time then includes the wake-ups, for the
    off steps as for the others. False where the driver refuses (no CUDA, no libcuda)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        handle = ctypes.c_int()
        ok = lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(handle), device) == 0
        return ok and lib.cuDevicePrimaryCtxSetFlags_v2(handle, 0x4) == 0
    except (OSError, AttributeError):
        return False


def bootstrap_ci(
    estimates: list[float], stat=np.median, level: float = 0.95, n: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of ``stat`` over per-period estimates:
    how well a run resolves an overhead (a 1% target needs an interval narrower than
    that)."""
    values = np.asarray(estimates, dtype=np.float64)
    rng = np.random.default_rng(seed)
    stats = stat(values[rng.integers(0, len(values), (n, len(values)))], axis=1)
    tail = (1 - level) / 2 * 100
    return float(np.percentile(stats, tail)), float(np.percentile(stats, 100 - tail))


def overhead_summary(wall: list[float], cpu: list[float], extra: str = "") -> str:
    """Per-period estimates (%) of wall and CPU time as one RESULTS.md phrase: median and
    mean with 95% bootstrap intervals, the count, ``extra``, then the CPU time's median
    and interval."""
    (m_lo, m_hi), (a_lo, a_hi) = bootstrap_ci(wall), bootstrap_ci(wall, np.mean)
    c_lo, c_hi = bootstrap_ci(cpu)
    return (
        f"{statistics.median(wall):+.2f}% (95% CI {m_lo:+.2f}..{m_hi:+.2f}, mean "
        f"{statistics.fmean(wall):+.2f}% CI {a_lo:+.2f}..{a_hi:+.2f}, {len(wall)} periods"
        f"{extra}; training thread's CPU time {statistics.median(cpu):+.2f}% CI "
        f"{c_lo:+.2f}..{c_hi:+.2f})"
    )


def low_percentile_ratio(times: list[float], q: float = 10.0) -> float:
    """Cost (%) from the q-th percentiles of the ON pairs and the off pairs.

    Host jitter only ever adds time, so low percentiles approach the jitter-free step
    and this ratio is steadier than the median of paired estimates on a noisy host.
    """
    on = [times[i] + times[i + 1] for i in range(ON, len(times) - 1, PERIOD)]
    off = [times[i - 2] + times[i - 1] for i in range(ON, len(times) - 1, PERIOD)]
    return (float(np.percentile(on, q)) / float(np.percentile(off, q)) - 1) * 100
