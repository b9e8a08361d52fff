"""What every framework callback holds: the monitors' settings, then a run and a handle.

No framework is imported here: each callback module imports its own framework and
mixes this in.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from syncless.errors import UsageError
from syncless.monitors import MonitorHandle, NonFiniteError, attach, build, parse_names
from syncless.monitors.alarm import Action, check_action
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
    ``every``: the fastest cadence (default: each monitor's own); ``on_nonfinite``:
    the nonfinite alarm's action (``attach``'s): under ``"raise"`` the callback stops
    training through the framework's own mechanism and keeps the error in
    ``stopped_by``, and the run directory is closed as after any training end.

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
        on_nonfinite: Action = "warn",
    ) -> None:
        self.monitors = parse_names(monitors)  # a clear error now, not at train begin
        self.run_dir, self.budget, self.every = run_dir, budget, every
        self.on_nonfinite = check_action(on_nonfinite)
        self.run_name = run_name or type(self).run_name
        self.run: Run | None = None
        self.handle: MonitorHandle | None = None
        self.stopped_by: NonFiniteError | None = None

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
        self.handle = attach(
            model, built, run=self.run, budget=self.budget, on_nonfinite=self.on_nonfinite
        )

    def step(self, step: int, **kwargs: Any) -> bool:
        """``handle.step``; True when the alarm raised: the framework should stop (every
        rank gets it at the same step: syncless.monitors.alarm)."""
        assert self.handle is not None
        try:
            self.handle.step(step, **kwargs)
        except NonFiniteError as e:
            self.stopped_by = e
            print(f"syncless: stopping training: {e}", file=sys.stderr)
            return True
        return False

    def close(self) -> None:
        try:
            if self.handle is not None:
                self.handle.close()
        except NonFiniteError as e:  # the last readout's: training has ended anyway
            self.stopped_by = self.stopped_by or e
            print(f"syncless: {e}", file=sys.stderr)
        finally:
            if self.run is not None:
                self.run.close()
