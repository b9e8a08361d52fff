"""Tensor capture: a device ring, a drain worker, recurring D2H windows, and sinks.

Here: the engine that owns the parts (``engine``, ``engine_setup``, ``arguments``,
``config``), the counters (``stats``), the first drop explained (``shortfall``), the
boundary clock (``boundary``), the window patterns (``windows``) and the writer pool
(``writer``). One concept per sub-package:

- ``ring``: the device ring, its record slots, the copy into it and when it landed;
- ``drain``: the drain worker, its transfers into pinned staging, windows and batching;
- ``controller``: the grant controller, how many bytes each window may carry;
- ``sinks``: where captured tensors go, and reading them back;
- ``simulate``: the controller replayed on a recorded trace.

The simulator is ``python -m syncless.capture.simulate TRACE.json`` (package
``syncless.capture.simulate``; not imported here so that ``-m`` runs it cleanly).
The windows, the controller and the simulator do not import torch; the engine, the
sinks and the reader (which do) are imported on first use of their names here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from syncless.capture.controller import (
    ControllerConfig,
    FlushKind,
    Grant,
    GrantController,
    GrantReason,
    Outcome,
    WindowEvidence,
)
from syncless.capture.windows import Location, PatternVersions, WindowPattern, pack, unpack

if TYPE_CHECKING:
    from syncless.capture.config import EngineConfig
    from syncless.capture.drain.window_reports import WindowReport
    from syncless.capture.engine import CaptureEngine
    from syncless.capture.sinks.fsspec import FsspecSink
    from syncless.capture.sinks.reader import CaptureStore, open
    from syncless.capture.sinks.shards import (
        CapturedRecord,
        CaptureSink,
        MemorySink,
        SafetensorsSink,
    )
    from syncless.capture.stats import DropReason
    from syncless.recompute import recomputing

# name -> module that defines it (torch-importing modules, loaded lazily)
_LAZY = {
    "CaptureEngine": "engine",
    "EngineConfig": "config",
    "WindowReport": "drain.window_reports",
    "DropReason": "stats",
    "CaptureSink": "sinks.shards",
    "CapturedRecord": "sinks.shards",
    "MemorySink": "sinks.shards",
    "SafetensorsSink": "sinks.shards",
    "FsspecSink": "sinks.fsspec",
    "CaptureStore": "sinks.reader",
    "open": "sinks.reader",
    "recomputing": "syncless.recompute",  # for capture hooks under activation checkpointing
}

__all__ = [
    "CaptureEngine",
    "CaptureSink",
    "CaptureStore",
    "CapturedRecord",
    "ControllerConfig",
    "DropReason",
    "EngineConfig",
    "FlushKind",
    "FsspecSink",
    "Grant",
    "GrantController",
    "GrantReason",
    "Location",
    "MemorySink",
    "Outcome",
    "PatternVersions",
    "SafetensorsSink",
    "WindowEvidence",
    "WindowPattern",
    "WindowReport",
    "open",
    "pack",
    "recomputing",
    "unpack",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'syncless.capture' has no attribute {name!r}")
    path = module if module.startswith("syncless.") else f"syncless.capture.{module}"
    value = getattr(importlib.import_module(path), name)
    globals()[name] = value  # later lookups skip this function
    return value
