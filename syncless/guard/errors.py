"""The error no_sync() raises and the record allow_sync() leaves behind."""

from __future__ import annotations

from typing import NamedTuple

from syncless.guard._sites import Site


class SyncError(RuntimeError):
    """An operation inside ``no_sync()`` would force a device-to-host sync.

    ``op`` is the operation's stable name (``Tensor.item``, ``aten.nonzero``, ...) and
    ``site`` the first stack frame outside torch and syncless.guard that caused it.
    """

    def __init__(self, message: str, op: str, site: Site) -> None:
        super().__init__(message)
        self.op = op
        self.site = site


class AllowedSync(NamedTuple):
    """One sync that ran inside ``allow_sync(reason)`` within a ``no_sync()`` block."""

    reason: str
    op: str
    site: Site
