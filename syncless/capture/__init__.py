"""Tensor capture: recurring D2H windows and the grant controller that fills them.

The simulator is ``python -m syncless.capture.simulate TRACE.json`` (module
``syncless.capture.simulate``; not imported here so that ``-m`` runs it cleanly).
The windows, the controller and the simulator do not import torch.
"""

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

__all__ = [
    "ControllerConfig",
    "FlushKind",
    "Grant",
    "GrantController",
    "GrantReason",
    "Location",
    "Outcome",
    "PatternVersions",
    "WindowEvidence",
    "WindowPattern",
    "pack",
    "unpack",
]
