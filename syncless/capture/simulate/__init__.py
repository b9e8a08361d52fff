"""The simulator: the grant controller replayed on a recorded trace, without a device.

``python -m syncless.capture.simulate TRACE.json`` prints a JSON summary (docs/capture.md).

- ``replay``: the discrete-event simulation, :func:`simulate`, and :func:`main`;
- ``trace``: the trace format, :class:`Trace`, :func:`parse_trace`, :func:`load_trace`.

No torch: the controller and the trace are pure Python.
"""

from __future__ import annotations

from syncless.capture.simulate.replay import main, simulate
from syncless.capture.simulate.trace import Trace, TraceError, load_trace, parse_trace

__all__ = ["Trace", "TraceError", "load_trace", "main", "parse_trace", "simulate"]
