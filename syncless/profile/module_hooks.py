"""``Profiler.hook_module``: every forward of a module timed as a section, by wrapping it.

:class:`ModuleHooks` is mixed into :class:`~syncless.profile.profiler.Profiler`. The
wrapper records the span itself on the short path (inside a step, the module not
re-entered, NVTX off) and goes through the sections' general path
(:mod:`syncless.profile.spans`) otherwise; :class:`ModuleHandle` takes the wrapper off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from syncless.hot_path import hot_path
from syncless.profile import summary as _summary
from syncless.profile.spans import _Span
from syncless.profile.timers import Timer

__all__ = ["ModuleHandle", "ModuleHooks"]


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


class ModuleHooks:
    """``hook_module`` for :class:`~syncless.profile.profiler.Profiler`.

    A mixin: the attributes below, and the sections it falls back on (``begin_section``,
    ``_section_id``, ``_open``, ``_close_innermost``), come from
    :class:`~syncless.profile.spans.SpanRecorder` and ``Profiler.__init__``.
    """

    nvtx: bool
    _timer: Timer
    _ids: dict[tuple[str, str], int]
    _meta: list[_summary.SectionTotals]
    _calls: list[int]
    _bytes: list[int]
    _in_step: bool
    _stack: list[_Span]
    _spans: list[tuple[int, Any, Any]]
    _self_ns: int

    def hook_module(
        self, module: nn.Module, name: str, category: str = "compute", bytes: int = 0
    ) -> list[ModuleHandle]:
        """Time every forward of ``module`` as section ``name``: its ``forward`` is
        wrapped in one frame that opens the section, runs it and closes the section
        (also when it raises). Returns a handle; ``remove()`` puts ``forward`` back.

        Same spans as ``begin_section``/``end_section`` around the forward, for less
        host time: the section id (at the first call, or here if the section exists)
        and its span object are bound once, and a wrapper, unlike a forward-pre-hook
        and a forward hook, does not take torch's hook dispatch (an identity module's call with the profiler's two hooks cost
        3.51 us on the CI host, 2.36 of it with empty hooks, against 0.80 plain:
        bench/RESULTS.md, hook_dispatch). A call the short path cannot take (outside a
        step, a re-entered module, a section closed out of order, NVTX on) takes the
        general path. Other hooks on the module run outside the section. A forward
        traced by ``torch.compile`` (the module, or a model around it, compiled) is not
        timed: the clock reads and event records would break the graph; time the
        compiled region from outside it (``section`` around its call).
        """
        # Reused: one module's forwards do not overlap. A section seen before starts on
        # the short path (the benchmarks hook a module again for every profiled step).
        span = _Span(self, self._ids.get((name, category), -1), bytes)
        clock = time.perf_counter_ns
        mark, mark_end = self._timer.mark, self._timer.mark_end
        stack = self._stack  # cleared in place, never replaced
        calls, sizes = self._calls, self._bytes
        previous = module.__dict__.get("forward")  # another wrapper, or None
        inner = module.forward

        compiling = torch.compiler.is_compiling

        @hot_path
        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            if compiling():
                # Traced into a torch.compile graph: a clock read or an event record
                # would break it; a compiled module is timed from outside its graph.
                return inner(*args, **kwargs)
            t_in = clock()
            if span._sid < 0 or span._token is not None or not self._in_step or self.nvtx:
                self._open_slow(span, name, category, bytes)
            else:
                stack.append(span)
                span._token = mark()
                self._self_ns += clock() - t_in
            try:
                return inner(*args, **kwargs)
            finally:
                t_in = clock()
                token = span._token
                if token is None or not stack or stack[-1] is not span or self.nvtx:
                    self._close_slow(span)
                else:
                    end = mark_end(token)
                    stack.pop()
                    sid = span._sid
                    self._spans.append((sid, token, end))
                    calls[sid] += 1
                    if bytes:
                        sizes[sid] += bytes
                    span._token = None
                    self._self_ns += clock() - t_in

        module.forward = timed_forward  # type: ignore[method-assign]
        return [ModuleHandle(module, timed_forward, previous)]

    def _open_slow(self, span: _Span, name: str, category: str, nbytes: int) -> None:
        """``hook_module``'s open when its short path does not apply."""
        if span._token is not None:  # the module re-entered itself: a span of its own
            self.begin_section(name, category, nbytes)
            return
        span._sid = self._section_id(name, category)  # interned at the first call
        self._open(span)

    def _close_slow(self, span: _Span) -> None:
        """``hook_module``'s close when its short path does not apply: close the
        innermost open span of the section (a re-entered call's own span, or ``span``
        with whatever was left open inside it)."""
        if self._in_step:  # else, as end_section: its begin was counted already
            name = self._meta[span._sid].name if span._sid >= 0 else "?"
            self._close_innermost(span._sid, f"module section {name!r} ended but it is not open")
