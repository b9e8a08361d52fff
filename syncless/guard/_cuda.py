"""``torch.cuda.set_sync_debug_mode("error")`` while any guard forbids syncs.

The sync debug mode is process-global (not per thread), so it is switched on when the
first forbidding guard appears, anywhere in the process, and the previous mode is put
back when the last one goes away.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_forbidding: set[int] = set()
_saved_mode: int = 0
_available: bool | None = None


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, asked once per process."""
    global _available
    if _available is None:
        _available = torch.cuda.is_available()
    return _available


def set_forbidding(key: int, forbidding: bool) -> None:
    """Record whether the guard session ``key`` currently forbids syncs, and apply it."""
    global _saved_mode
    if not cuda_available():
        return
    with _lock:
        before = bool(_forbidding)
        if forbidding:
            _forbidding.add(key)
        else:
            _forbidding.discard(key)
        after = bool(_forbidding)
        if after and not before:
            _saved_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        elif before and not after:
            torch.cuda.set_sync_debug_mode(_saved_mode)
