"""What ``Profiler.hook_module`` returns: :class:`ModuleHandle` takes the timed forward off.

The wrapper itself is made by
:meth:`SpanRecorder.hook_module <syncless.profile.spans.SpanRecorder.hook_module>`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["ModuleHandle"]


class ModuleHandle:
    """What ``Profiler.hook_module`` returns: ``remove()`` puts the module's forward
    back, unless something wrapped it again since (then that wrapper keeps ours)."""

    def __init__(self, module: nn.Module, wrapper: Callable[..., Any], previous: Any) -> None:
        self._module, self._wrapper, self._previous = module, wrapper, previous

    def remove(self) -> None:
        module = self._module
        if module.__dict__.get("forward") is not self._wrapper:
            return  # removed already, or wrapped again since
        if self._previous is None:
            del module.forward  # the class's forward again
        else:
            module.forward = self._previous  # type: ignore[method-assign]
