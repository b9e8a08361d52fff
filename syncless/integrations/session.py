"""What every framework callback holds: the monitors' settings, then a run and a handle.

No framework is imported here: each callback module imports its own framework and
mixes this in.
"""

from __future__ import annotations

from typing import Any

import torch

from syncless.errors import UsageError
from syncless.monitors import MonitorHandle, attach, build, parse_names
from syncless.monitors.budget import DEFAULT_BUDGET
from syncless.run import Run


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model under DDP / Accelerate / torch.compile wrappers (``module``,
    ``_orig_mod``)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under Accelerate's ``AcceleratedOptimizer`` (``optimizer``).

    The wrapper subclasses ``torch.optim.Optimizer`` without its hook tables, so it is
    unwrapped by attribute, not by type."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


class MonitorSession:
    """``monitors``: ``"all"`` or a comma list (``syncless.monitors.build``);
    ``run_dir``: the run directory (default ``runs/<time>-<run_name>``); ``budget``:
    the share of the step the monitors may cost (``None``: fixed cadences);
    ``every``: the fastest cadence (default: each monitor's own).

    ``run`` and ``handle`` exist from ``open`` on; after ``close`` the handle is kept,
    closed: its counters and last readouts stay readable."""

    run_name = "run"  # the run directory's suffix; each framework's callback names its own

    def __init__(
        self,
        monitors: str = "all",
        run_dir: str | None = None,
        run_name: str | None = None,
        budget: float | None = DEFAULT_BUDGET,
        every: int | None = None,
    ) -> None:
        self.monitors = parse_names(monitors)  # a clear error now, not at train begin
        self.run_dir, self.budget, self.every = run_dir, budget, every
        self.run_name = run_name or type(self).run_name
        self.run: Run | None = None
        self.handle: MonitorHandle | None = None

    def open(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        config: dict[str, Any] | None = None,
    ) -> None:
        if "norms" in self.monitors and optimizer is None:
            raise UsageError(
                f"{type(self).__name__}: the norms monitor needs the framework's (one) "
                "torch optimizer and none was found; leave norms out of monitors="
            )
        self.run = Run(name=self.run_name, run_dir=self.run_dir, config=config)
        built = build(self.monitors, optimizer=optimizer, every=self.every)
        self.handle = attach(model, built, run=self.run, budget=self.budget)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
        if self.run is not None:
            self.run.close()
