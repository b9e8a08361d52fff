"""Built-in monitors on top of syncless.metrics: attention, moe, activations, norms,
nonfinite. ``attach(model, build("all", optimizer=opt), run=run)`` then
``handle.step(step)`` once per training step (``handle.step(step, loss=, grad_norm=)``
to have the nonfinite alarm check those too)."""

from syncless.monitors.alarm import NonFiniteError, NonFiniteEvent, SpikeError, SpikeEvent
from syncless.monitors.attach import attach
from syncless.monitors.base import AREA, Monitor, MonitorContext
from syncless.monitors.handle import MonitorHandle
from syncless.monitors.registry import MONITORS, build, parse_names

__all__ = [
    "AREA",
    "MONITORS",
    "Monitor",
    "MonitorContext",
    "MonitorHandle",
    "NonFiniteError",
    "NonFiniteEvent",
    "SpikeError",
    "SpikeEvent",
    "attach",
    "build",
    "parse_names",
]
