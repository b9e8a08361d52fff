"""Runtime sync detection: ``no_sync()`` raises, ``census()`` counts, ``capture_check()`` dry-runs capture.

See docs/guard.md.
"""

from syncless.guard._sites import Site
from syncless.guard.capture import CaptureResult, capture_check
from syncless.guard.counting import Census, census
from syncless.guard.errors import AllowedSync, SyncError
from syncless.guard.strict import NoSync, allow_sync, no_sync

__all__ = [
    "AllowedSync",
    "CaptureResult",
    "Census",
    "NoSync",
    "Site",
    "SyncError",
    "allow_sync",
    "capture_check",
    "census",
    "no_sync",
]
