"""The demo's step log: loss and friends read back one step late, throughput and MFU.

A logged step's statistics (loss, balance loss, gradient norm, the stop flag) are
stacked on the device, all-reduced across ranks and copied into pinned host memory
without waiting (``syncless.pacing.HostLanding``). They are read after the *next*
step has been enqueued, so the read waits for a step the device has mostly done while
the host already holds the next one: the device never idles for the log, and the host
stays at most a step ahead. Step time is the wall time between two reads over the
steps between them: each read returns when its step has finished on the device.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from syncless.demo.experts import Experts
from syncless.demo.flops import Peak
from syncless.pacing import HostLanding
from syncless.run import Run, rank_info


@dataclass(frozen=True)
class Throughput:
    """What turns a step time into tokens/s and MFU."""

    tokens_per_step: int  # global: every rank's batch
    flops_per_token: int
    peak: Peak
    gpus: int  # MFU is per GPU (ranks that share a GPU add up on it); 0 on a CPU

    def metrics(self, step_s: float) -> dict[str, float]:
        tokens_per_s = self.tokens_per_step / step_s
        out = {"demo/step/step_ms": step_s * 1e3, "demo/step/tokens_per_s": tokens_per_s}
        if self.peak.flops is not None and self.gpus > 0:
            achieved = tokens_per_s * self.flops_per_token / self.gpus
            out["demo/step/mfu_frac"] = achieved / self.peak.flops
        return out


# The end of a step's work: a CUDA event (device timeline) or a host clock reading (CPU).
_Mark = torch.cuda.Event | float


def _mark(device: torch.device) -> _Mark:
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _seconds(start: _Mark, end: _Mark) -> float:
    if isinstance(start, float) and isinstance(end, float):
        return end - start
    assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
    return start.elapsed_time(end) / 1e3  # both have completed: no wait


@dataclass
class _Logged:
    step: int
    steps: int  # steps since the previous logged step
    end: _Mark
    host: dict[str, float]  # values known on the host when the step was enqueued


class StepLog:
    """Issue a logged step's statistics, read them a step later, log them to ``run``.

    ``dropping``: expert modules that drop rows over capacity; their counts ride along.
    ``rows_per_step``: (token, expert) rows one rank routes per step over all layers.
    """

    def __init__(
        self,
        run: Run,
        throughput: Throughput,
        device: torch.device,
        first_step: int,
        dropping: Sequence[Experts] = (),
        rows_per_step: int = 0,
    ) -> None:
        self.run = run
        self.throughput = throughput
        self.device = device
        self.dropping = list(dropping)
        self.rows_per_step = rows_per_step
        self.landing = HostLanding()
        self.pending: _Logged | None = None
        self.last_end = _mark(device)  # before the first step
        self.last_issued = first_step - 1
        self.world = rank_info().world_size

    def issue(
        self,
        step: int,
        loss: torch.Tensor,
        balance: torch.Tensor,
        grad_norm: torch.Tensor,
        stop: float,
        host: dict[str, float],
    ) -> None:
        """Stack, reduce and start copying this step's statistics (no wait)."""
        values = [loss.detach().float(), balance.detach().float(), grad_norm,
                  torch.full_like(grad_norm, stop)]  # fmt: skip
        if self.dropping:
            dropped = [e.dropped_rows for e in self.dropping if e.dropped_rows is not None]
            values.append(torch.stack(dropped).sum().float() if dropped else grad_norm * 0)
            for e in self.dropping:
                e.dropped_rows = None
        stats = torch.stack(values)
        world = self.world
        if world > 1:
            # grad_norm is already global (equal on every rank), so the mean keeps it.
            dist.all_reduce(stats)
            stats /= world
        if self.device.type == "cuda":
            host = {**host, "demo/step/max_memory_mb": torch.cuda.max_memory_allocated() / 2**20}
        end = _mark(self.device)  # before the copy: landed, the copy says this has passed
        self.landing.issue(stats)
        self.pending = _Logged(step, step - self.last_issued, end, host)
        self.last_issued = step

    def finish(self) -> tuple[int, float, bool] | None:
        """Read and log the pending step: (step, global loss, stop asked), or None."""
        logged, self.pending = self.pending, None
        if logged is None:
            return None
        values = self.landing.read()  # waits for the step's copy, if it has not landed
        step_s = _seconds(self.last_end, logged.end) / logged.steps
        self.last_end = logged.end
        loss, balance, grad_norm, stop = values[:4]
        metrics = {
            "demo/step/loss": loss,
            "demo/step/balance_loss": balance,
            "demo/step/grad_norm": grad_norm,
            **self.throughput.metrics(step_s),
            **logged.host,
        }
        if self.dropping:
            metrics["demo/step/dropped_rows_frac"] = values[4] / (self.rows_per_step * logged.steps)
        self.run.log(logged.step, metrics)
        return logged.step, loss, stop > 0
