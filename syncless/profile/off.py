"""The ``off`` profiler: one shared object whose every call does nothing but call ``fn``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from torch import nn

from syncless.hot_path import hot_path
from syncless.profile import collective_calls

if TYPE_CHECKING:
    from syncless.profile.module_hooks import ModuleHandle

F = TypeVar("F", bound=Callable[..., Any])


class _NullContext:
    __slots__ = ()

    def __enter__(self) -> _NullContext:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_NULL = _NullContext()


class NullProfiler:
    """``Profiler(mode="off")``: same API, no state, no timing, no collectives.

    ``section``/``step`` return one shared context object; ``collective`` and the
    wrappers call the collective and return its result; ``report`` returns ``None``.
    """

    mode = "off"
    calibration = None
    group = None  # the wrappers' default group, as a Profiler built without one

    @hot_path
    def section(self, name: str, category: str = "compute", bytes: int = 0) -> _NullContext:
        return _NULL

    def step(self, step: int | None = None) -> _NullContext:
        return _NULL

    def begin_step(self, step: int | None = None) -> None:
        return None

    def end_step(self) -> None:
        return None

    @hot_path
    def begin_section(self, name: str, category: str = "compute", bytes: int = 0) -> None:
        return None

    @hot_path
    def end_section(self, name: str) -> None:
        return None

    def section_fn(self, name: str | None = None, category: str = "compute") -> Callable[[F], F]:
        return lambda fn: fn  # the function itself: zero cost per call

    def hook_module(
        self, module: nn.Module, name: str, category: str = "compute", bytes: int = 0
    ) -> list[ModuleHandle]:
        return []  # no wrapper: a module profiled "off" runs exactly as without a profiler

    @hot_path
    def collective(
        self, name: str, fn: Callable[..., Any], *args: Any, rendezvous: bool = True, **kw: Any
    ) -> Any:
        return fn(*args, **kw)

    # The same calls as the profiler's, through the plain ``collective`` above.
    all_reduce = collective_calls.all_reduce
    all_to_all_single = collective_calls.all_to_all_single
    all_gather_into_tensor = collective_calls.all_gather_into_tensor

    def calibrate(self) -> None:
        return None

    def report(
        self, step: int | None = None, *, force: bool = False, print_table: bool = False
    ) -> None:
        return None


OFF = NullProfiler()
