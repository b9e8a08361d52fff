"""The plug for syncless tools in the demo: each ``--<tool>`` switch adds a DemoTool.

The training loop calls every tool at fixed points and nowhere else, so a tool cannot
change the workload except through what it measures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from rich.console import Console
from torch import nn

from syncless.demo.config import DemoConfig
from syncless.run import Run


@dataclass
class DemoContext:
    """What a tool sees of the demo: built once, before the first step.

    ``console`` is the demo's (shared with its live view, quiet under --quiet).
    """

    cfg: DemoConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    run: Run
    console: Console
    expert_parallel: bool
    # The training loop times its phases through this; a profiling tool replaces the
    # shared no-op (syncless.profile.OFF) in attach().
    profiler: Any = None
    # step -> (inputs, targets) on the host; a data-plane tool routes it through a store.
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
    # The step's loss and global gradient norm, device tensors, set before
    # ``step_enqueued``: the monitors' nonfinite alarm checks them on the device.
    checked: dict[str, torch.Tensor] = field(default_factory=dict)


class DemoTool(Protocol):
    name: str

    def attach(self, ctx: DemoContext) -> None:
        """Once, after the model and optimizer are built, before the first step."""

    def step_begin(self, step: int) -> None:
        """Before the step's forward."""

    def step_end(self, step: int) -> None:
        """After the optimizer step and the step's logging (cold path: the tool may
        flush and emit records)."""

    # Optional: ``step_enqueued(step)``, called after the optimizer step is enqueued and
    # before the step's host read-back (the loss log). Host work there that needs no
    # result of this step (a lagged flush) runs while the device is still busy with
    # the backward and the optimizer, instead of after the read-back, when the device
    # has gone idle and waits for the next step's first kernels.

    def close(self) -> None:
        """After the last step; emit final records and release hooks."""
