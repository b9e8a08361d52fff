"""Keep the guard's function mode active inside the autograd engine.

torch stashes a ``TorchFunctionMode`` while its ``__torch_function__`` runs, and
``Tensor.backward`` / ``torch.autograd.backward`` / ``torch.autograd.grad`` are torch
functions: without help, the whole backward pass (and so every backward and tensor
hook) runs with the mode stashed, and ``.tolist()``, ``.cpu()``, ``.numpy()`` in a
hook go unseen (the dispatch mode still sees ``.item()``, ``nonzero``, ...).

The fix: while the guard's handler runs one of those functions, the module-level
``torch.autograd._engine_run_backward`` (which both call by global name, right before
entering the C++ engine) is wrapped to push the mode back. The engine snapshots the
thread-local mode stack when the backward starts, so hooks see the mode on the
calling thread (CPU) and on the engine's device threads (CUDA). The wrapper is
installed while any guard session is open and only acts for the thread that asked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ATTR = "_engine_run_backward"
_tls = threading.local()
_lock = threading.Lock()
_installs = 0
_original: Callable[..., Any] | None = None

# The torch functions whose body runs the autograd engine (and so user hooks).
AUTOGRAD_ENTRIES: frozenset[object] = frozenset(
    {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}
)


def available() -> bool:
    """Whether this torch has the engine entry point the bridge wraps."""
    return callable(getattr(torch.autograd, _ATTR, None))


def _pending() -> list[TorchFunctionMode]:
    pending = getattr(_tls, "pending", None)
    if pending is None:
        pending = _tls.pending = []
    return pending


def _engine_with_modes(*args: Any, **kwargs: Any) -> Any:
    pending = _pending()
    original = _original
    if original is None:  # uninstalled while a caller still held the wrapper
        original = getattr(torch.autograd.graph, _ATTR)
    if not pending:
        return original(*args, **kwargs)
    modes = list(pending)
    # A backward started from inside a hook asks again through its own handler.
    pending.clear()
    for mode in modes:
        mode.__enter__()
    try:
        return original(*args, **kwargs)
    finally:
        for mode in reversed(modes):
            mode.__exit__(None, None, None)
        pending.extend(modes)


def install() -> None:
    """Wrap the engine entry point (reference counted)."""
    global _installs, _original
    if not available():
        return
    with _lock:
        if _original is None:  # not set means ours is not in the call chain
            _original = getattr(torch.autograd, _ATTR)
            setattr(torch.autograd, _ATTR, _engine_with_modes)
        _installs += 1


def uninstall() -> None:
    """Undo one ``install()``; the last one restores torch's own function."""
    global _installs, _original
    if not available():
        return
    with _lock:
        if _installs == 0:
            return
        _installs -= 1
        # A wrapper someone else installed on top of ours stays, and ours stays below
        # it as a pass-through (it acts only for threads that ask).
        if _installs == 0 and getattr(torch.autograd, _ATTR) is _engine_with_modes:
            setattr(torch.autograd, _ATTR, _original)
            _original = None


def call_with_mode(
    mode: TorchFunctionMode,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> Any:
    """Run an autograd entry point so that ``mode`` is active inside the engine."""
    pending = _pending()
    pending.append(mode)
    try:
        return func(*args, **kwargs)
    finally:
        pending.pop()
