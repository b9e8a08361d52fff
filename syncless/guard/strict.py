"""``no_sync()``: raise on anything that would force a device-to-host sync."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from syncless.guard import _cuda, _session
from syncless.guard._sites import traceback_site
from syncless.guard.errors import AllowedSync, SyncError

# torch's message when set_sync_debug_mode("error") trips (c10/cuda/CUDAFunctions.cpp).
_CUDA_SYNC_MESSAGE = "called a synchronizing CUDA operation"


class NoSync:
    """A ``no_sync()`` block. ``allowed`` lists the syncs ``allow_sync`` let through.

    Reusable and reentrant: entering it again (or nesting another guard) shares the
    detection modes already active on the thread.
    """

    def __init__(self, *, cpu_as_device: bool | None = None) -> None:
        self.cpu_as_device = (
            (not _cuda.cuda_available()) if cpu_as_device is None else cpu_as_device
        )
        self.allowed: list[AllowedSync] = []
        self._entries: list[tuple[_session.Session, _session.ForbidFrame]] = []

    def __enter__(self) -> NoSync:
        frame = _session.ForbidFrame(self, self.cpu_as_device)
        self._entries.append((_session.enter(frame), frame))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, frame = self._entries.pop()
        _session.leave(session, frame)
        if (
            isinstance(exc, RuntimeError)
            and not isinstance(exc, SyncError)
            and _CUDA_SYNC_MESSAGE in str(exc)
        ):
            # A sync only CUDA's own sync debug mode saw: give it the same shape as ours.
            site = traceback_site(tb)
            raise SyncError(
                "a synchronizing CUDA operation ran inside no_sync() (caught by "
                "torch.cuda.set_sync_debug_mode, not by syncless's op rules).\n"
                f"  at {site.file}:{site.line} in {site.function}\n"
                f"  torch said: {exc}\n"
                "  If this sync is intended, wrap it in "
                '`with syncless.guard.allow_sync("<why>"):`.',
                "cuda.sync_debug_mode",
                site,
            ) from exc


def no_sync(*, cpu_as_device: bool | None = None) -> NoSync:
    """Raise ``SyncError`` on any operation that would force a device-to-host sync.

    Use as ``with no_sync() as guard:``. The error names the operation and the first
    stack frame outside torch and syncless.guard that caused it, with a fix. Forward,
    pre-forward, backward and tensor hooks run under it when the forward/backward call
    is inside the block.

    ``cpu_as_device`` treats CPU tensors as if they lived on the GPU; it defaults to
    True when CUDA is unavailable (so a CPU-only test run catches what would sync on
    a GPU) and False otherwise (so host-side tensors are not flagged). On CUDA the
    block also sets ``torch.cuda.set_sync_debug_mode("error")``, which is
    process-global: every thread is affected while any ``no_sync()`` is active.
    """
    return NoSync(cpu_as_device=cpu_as_device)


@contextmanager
def allow_sync(reason: str) -> Iterator[None]:
    """Permit intended syncs inside ``no_sync()``; ``reason`` says why (required).

    Each permitted sync is appended to the enclosing guards' ``allowed`` list as
    ``AllowedSync(reason, op, site)``; on CUDA the sync debug mode is relaxed for the
    block. Outside any guard it does nothing. A ``no_sync()`` nested inside it forbids
    syncs again.
    """
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(
            f"allow_sync() needs a reason, got {reason!r}: say why this sync is "
            'intended, e.g. allow_sync("read the loss once per step for logging")'
        )
    session = _session.current_session()
    if session is None:
        yield
        return
    frame = _session.AllowFrame(reason.strip())
    session.push(frame)
    try:
        yield
    finally:
        _session.leave(session, frame)
