"""The plug for syncless tools in the demo: each ``--<tool>`` switch adds a DemoTool.

The training loop calls every tool at fixed points and nowhere else, so a tool cannot
change the workload except through what it measures.
"""

from __future__ import annotations

from typing import Protocol

from rich.console import Console
from torch import nn

from syncless.run import Run


class DemoTool(Protocol):
    name: str

    def attach(self, model: nn.Module, run: Run, console: Console) -> None:
        """Once, after the model is built and before the first step.

        ``console`` is the demo's (shared with its live view, quiet under --quiet).
        """

    def step_begin(self, step: int) -> None:
        """Before the step's forward."""

    def step_end(self, step: int) -> None:
        """After the optimizer step and the step's logging (cold path: the tool may
        flush and emit records)."""

    def close(self) -> None:
        """After the last step; emit final records and release hooks."""
