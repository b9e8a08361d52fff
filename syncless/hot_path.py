"""Marker for hot-path functions: code that runs inside a training step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def hot_path(fn: F) -> F:
    """Mark ``fn`` as hot-path code for ``syncless lint``.

    It changes nothing at run time; the linter applies the hot-path rules (no host
    sync, no collective, no schema changes) to the function and to the functions of
    the same module it calls.
    """
    fn.__syncless_hot_path__ = True
    return fn
