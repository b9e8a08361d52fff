"""Engines for the pattern-driven drain tests, stepped by hand with a fake clock.

``background=False`` engines drain only inside ``poll()``, so every test is a fixed
sequence of boundaries, clock values and polls. The controller is the real one, or a
:class:`ScriptedController` that records what the engine reported; either way the
expected values come from the sequence itself (the clock, the record sizes), not from
the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from syncless.capture import (
    CaptureEngine,
    EngineConfig,
    Grant,
    GrantController,
    MemorySink,
    WindowPattern,
)

ONE_WINDOW = WindowPattern(2, [(0, 1)])  # boundary 2k OPENs window 0, 2k+1 CLOSEs it


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class ScriptedController(GrantController):
    """Grants a scripted number of records per window and records every call."""

    def __init__(self, staging_bytes: int, records: list[int]) -> None:
        super().__init__(staging_bytes)
        self.script = list(records)
        self.offered: list[list[int]] = []
        self.completions: list[dict[str, Any]] = []
        self.last_durations: list[float | None] = []

    def grant(
        self, position: int, occurrence: int, ready: Any, window_s: float | None = None
    ) -> Grant:
        sizes = list(ready)
        self.offered.append(sizes)
        self.last_durations.append(window_s)
        k = min(self.script.pop(0), len(sizes))
        base = super().grant(position, occurrence, ())  # version and epoch, no records
        nbytes = sum(sizes[:k])
        return dataclasses.replace(base, budget=nbytes, records=k, nbytes=nbytes)

    def complete(self, grant: Grant, **kwargs: Any) -> Any:
        self.completions.append({"grant": grant, **kwargs})
        return super().complete(grant, **kwargs)


def engine_for(
    controller: GrantController | None = None,
    ring: int = 1 << 16,
    staging: int = 1 << 12,
    clock: Clock | None = None,
    sink: MemorySink | None = None,
    **config: Any,
) -> CaptureEngine:
    return CaptureEngine(
        ring,
        staging,
        sink if sink is not None else MemorySink(),
        device="cpu",
        background=False,
        clock=clock or Clock(),
        controller=controller,
        config=EngineConfig(**config),
    )


def floats(n: int, value: float) -> torch.Tensor:
    return torch.full((n,), float(value), dtype=torch.float32)


def planned_engine(
    controller: GrantController | None = None, clock: Clock | None = None, **config: Any
) -> tuple[CaptureEngine, MemorySink]:
    sink = MemorySink()
    engine = engine_for(controller, clock=clock, sink=sink, planned_windows=True, **config)
    return engine, sink
