"""The drain: the worker thread that moves whole records out of the device ring.

:class:`DrainWorker` (``worker``) runs the loop, its thread and wake-ups, and owns
the parts, one per module:

- ``requests``: drains other threads ask for (flushes, close, captures that block);
- ``transfers``: the drain's transfers: ready records, in flight, finished;
- ``staging``: the copies out of the device ring into pinned staging;
- ``windows``: window grants: the boundary word, planned and observed window copies;
- ``window_reports``: :class:`WindowReport`, window transfers reported at their CLOSE;
- ``batching``: batching without windows, captures gathered into shard-sized transfers.
"""

from __future__ import annotations

from syncless.capture.drain.batching import DrainBatching
from syncless.capture.drain.requests import MAX_INFLIGHT, DrainRequests, Request
from syncless.capture.drain.staging import StagedRecords, StagingCopier, Transfer
from syncless.capture.drain.transfers import DrainTransfers
from syncless.capture.drain.window_reports import WindowReport, WindowReporter
from syncless.capture.drain.windows import DrainWindows, Plan
from syncless.capture.drain.worker import DrainWorker

__all__ = [
    "MAX_INFLIGHT",
    "DrainBatching",
    "DrainRequests",
    "DrainTransfers",
    "DrainWindows",
    "DrainWorker",
    "Plan",
    "Request",
    "StagedRecords",
    "StagingCopier",
    "Transfer",
    "WindowReport",
    "WindowReporter",
]
