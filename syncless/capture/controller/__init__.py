"""The grant controller: how many bytes each recurring window may carry.

Pure Python and deterministic (no torch, no clock): the engine tells it what happened
and it answers with grants. One concept per module:

- ``grants``: :class:`GrantController`, its calls, what a grant is made of, and which
  completions and flushes count as evidence;
- ``types``: the values it exchanges with the engine (:class:`Grant`,
  :class:`GrantReason`, :class:`Outcome`, :class:`FlushKind`, :class:`WindowEvidence`);
- ``config``: :class:`ControllerConfig`, the knobs;
- ``learning``: the evidence per window position (A, B and E) and the budget it yields;
- ``fallback``: when repeated capacity flushes end the windows.
"""

from __future__ import annotations

from syncless.capture.controller.config import ControllerConfig
from syncless.capture.controller.grants import GrantController
from syncless.capture.controller.types import (
    FlushKind,
    Grant,
    GrantReason,
    Outcome,
    WindowEvidence,
)

__all__ = [
    "ControllerConfig",
    "FlushKind",
    "Grant",
    "GrantController",
    "GrantReason",
    "Outcome",
    "WindowEvidence",
]
