"""The profiler's hot path: sections and collectives recorded as spans of timer tokens.

:class:`SpanRecorder` is the recording side of :class:`~syncless.profile.profiler.Profiler`
(a mixin: ``Profiler.__init__`` sets up the state it uses). Entering and leaving a
section, and each collective, take a timestamp token from the timer, append ``(section
id, start token, end token)`` to this step's span list and count the call; nothing waits
for the device (except in the opt-in ``collectives``/``sync`` modes) and nothing crosses
ranks except the 1-element rendezvous all_reduce the caller asked for. A section gets its
id at its first use (interning). Misuse inside a step is counted, or raised as
:class:`ProfileMisuse` with ``strict=True``.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from syncless.hot_path import hot_path
from syncless.profile import names as _names
from syncless.profile import summary as _summary
from syncless.profile.timers import Timer

__all__ = ["ProfileMisuse", "SpanRecorder"]

F = TypeVar("F", bound=Callable[..., Any])


class ProfileMisuse(RuntimeError):
    """Raised for in-step misuse only with ``strict=True``; otherwise it is counted."""


class _Span:
    """The context manager ``Profiler.section`` returns (one small object per call)."""

    __slots__ = ("_bytes", "_prof", "_sid", "_token")

    def __init__(self, prof: SpanRecorder, sid: int, nbytes: int) -> None:
        self._prof = prof
        self._sid = sid
        self._bytes = nbytes
        self._token: Any = None

    @hot_path
    def __enter__(self) -> _Span:
        self._prof._open(self)
        return self

    @hot_path
    def __exit__(self, *exc: object) -> None:
        self._prof._close(self)


class SpanRecorder:
    """Sections, collectives and misuse for :class:`~syncless.profile.profiler.Profiler`.

    A mixin: the attributes below are set up by ``Profiler.__init__`` (and
    ``Profiler._setup``), which says what each one holds.
    """

    strict: bool
    nvtx: bool
    group: dist.ProcessGroup | None
    _timer: Timer
    _sync_collectives: bool
    _ids: dict[tuple[str, str], int]
    _coll: dict[str, tuple[int, int, int, int]]
    _meta: list[_summary.SectionTotals]
    _calls: list[int]
    _bytes: list[int]
    _host_ns: list[int]
    _time_ns: list[float]
    _seen: list[bool]
    _by_name: dict[str, int]
    _in_step: bool
    _stack: list[_Span]
    _spans: list[tuple[int, Any, Any]]
    _self_ns: int
    _misuse: int
    _warned: set[str]
    _rdv: torch.Tensor | None

    # -- interning (a name's first use) -------------------------------------------------

    def _intern(self, name: str, kind: str, category: str, parent: str | None) -> int:
        sid = len(self._meta)
        self._meta.append(_summary.SectionTotals(name, category, kind, parent))
        self._calls.append(0)
        self._bytes.append(0)
        self._host_ns.append(0)
        self._time_ns.append(0.0)
        self._seen.append(False)
        return sid

    def _parent(self) -> str | None:
        return self._meta[self._stack[-1]._sid].name if self._stack else None

    def _section_id(self, name: str, category: str) -> int:
        key = (name, category)
        sid = self._ids.get(key)
        if sid is None:
            if category not in _names.CATEGORIES:
                self._misused(
                    "category",
                    f"unknown section category {category!r} for {name!r}; expected one of "
                    f"{_names.CATEGORIES} (recorded as 'compute')",
                )
                category = "compute"
            clean = _names.sanitize(name)
            sid = next(
                (i for i, m in enumerate(self._meta) if m.name == clean and m.kind == "section"),
                None,
            )
            if sid is None:
                sid = self._intern(clean, "section", category, self._parent())
            self._ids[key] = sid
            self._by_name.setdefault(name, sid)
        return sid

    def _collective_ids(self, name: str) -> tuple[int, int, int, int]:
        ids = self._coll.get(name)
        if ids is None:
            clean = _names.sanitize(name)
            cid = self._intern(clean, "collective", "collective", self._parent())
            parts = tuple(
                self._intern(f"{clean}/{p}", "part", "collective", clean)
                for p in _names.COLLECTIVE_PARTS
            )
            ids = self._coll[name] = (cid, *parts)  # type: ignore[assignment]
        return ids  # type: ignore[return-value]

    # -- misuse ---------------------------------------------------------------------

    def _misused(self, key: str, message: str) -> None:
        self._misuse += 1
        if self.strict:
            raise ProfileMisuse(message)
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(
                f"syncless.profile: {message} (counted in profile/self/misuse_count; "
                "further cases are counted, not warned)",
                RuntimeWarning,
                stacklevel=4,
            )

    # -- sections (hot) ---------------------------------------------------------------

    @hot_path
    def section(self, name: str, category: str = "compute", bytes: int = 0) -> _Span:
        """A span: ``with prof.section("attn"):``. ``bytes`` per call gives GB/s.

        Nesting is allowed; the same name under two parents shares one row.
        """
        return _Span(self, self._section_id(name, category), bytes)

    def section_fn(self, name: str | None = None, category: str = "compute") -> Callable[[F], F]:
        """Decorator: run the function inside ``section(name or fn.__name__)``."""

        def wrap(fn: F) -> F:
            label = name or fn.__name__

            @functools.wraps(fn)
            def inner(*args: Any, **kwargs: Any) -> Any:
                with self.section(label, category):
                    return fn(*args, **kwargs)

            return inner  # type: ignore[return-value]

        return wrap

    @hot_path
    def begin_section(self, name: str, category: str = "compute", bytes: int = 0) -> None:
        """Open a section without a ``with`` block; close it with ``end_section(name)``."""
        self._open(_Span(self, self._section_id(name, category), bytes))

    @hot_path
    def end_section(self, name: str) -> None:
        """Close the innermost open section called ``name``."""
        if self._in_step:  # else its begin was counted already (outside a step)
            self._close_innermost(
                self._by_name.get(name, -1),
                f"end_section({name!r}): section {name!r} is not open",
            )

    def _close_innermost(self, sid: int, not_open: str) -> None:
        """Close the innermost open span of section ``sid`` (misuse if there is none)."""
        for span in reversed(self._stack):
            if span._sid == sid:
                self._close(span)
                return
        self._misused("not-open", not_open)

    @hot_path
    def _open(self, span: _Span) -> None:
        t_in = time.perf_counter_ns()
        if not self._in_step:
            self._misused("outside", "a section was entered outside a step; not timed")
            return
        if self.nvtx:
            torch.cuda.nvtx.range_push(self._meta[span._sid].name)
        self._stack.append(span)
        span._token = self._timer.mark()
        self._self_ns += time.perf_counter_ns() - t_in

    @hot_path
    def _close(self, span: _Span) -> None:
        t_in = time.perf_counter_ns()
        if span._token is None:
            return  # entered outside a step: already counted at entry
        end = self._timer.mark_end(span._token)
        stack = self._stack
        if not stack or stack[-1] is not span:
            name = self._meta[span._sid].name
            if span not in stack:
                self._misused("not-open", f"section {name!r} ended but it is not open")
                span._token = None
                return
            # Ended out of order: drop the sections opened inside it and still open.
            self._misused("nesting", f"section {name!r} ended before the sections inside it")
            while stack[-1] is not span:
                stack.pop()
                if self.nvtx:
                    torch.cuda.nvtx.range_pop()  # keep the NVTX stack balanced
        stack.pop()
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        self._spans.append((span._sid, span._token, end))
        self._calls[span._sid] += 1
        self._bytes[span._sid] += span._bytes
        span._token = None
        self._self_ns += time.perf_counter_ns() - t_in

    # -- collectives (hot) ------------------------------------------------------------

    @hot_path
    def collective(
        self, name: str, fn: Callable[..., Any], *args: Any, rendezvous: bool = True, **kw: Any
    ) -> Any:
        """Call ``fn(*args, **kw)`` and time it as ``name/enqueue|rendezvous|transfer``.

        With ``rendezvous=True`` (and a process group) a 1-element all_reduce on the same
        group is issued right before ``fn``: the time spent in it is this rank's wait
        for the last rank to arrive, so ``transfer`` holds the collective alone.
        ``enqueue`` is host time inside ``fn`` (on gloo, which is synchronous, it
        contains the transfer). Use blocking calls (no ``async_op=True``): with an
        async op ``transfer`` only covers the enqueue.
        """
        t_in = time.perf_counter_ns()
        if not self._in_step:
            self._misused("coll-outside", f"collective {name!r} outside a step; not timed")
            return fn(*args, **kw)
        cid, eid, rid, tid = self._collective_ids(name)
        timer = self._timer
        if self._sync_collectives:
            torch.cuda.synchronize()  # syncless: ok opt-in collectives mode
        a = timer.mark()
        rdv_ns = 0
        b = a
        if rendezvous and self._rdv is not None:
            r0 = time.perf_counter_ns()
            group = kw.get("group", self.group)
            # The rendezvous probe: its wait is the skew measurement the caller asked for.
            dist.all_reduce(self._rdv, group=group)  # syncless: collective-ok skew probe
            rdv_ns = time.perf_counter_ns() - r0
            b = timer.mark()
        h0 = time.perf_counter_ns()
        out = fn(*args, **kw)
        fn_ns = time.perf_counter_ns() - h0
        if self._sync_collectives:
            torch.cuda.synchronize()  # syncless: ok opt-in collectives mode
        c = timer.mark()
        spans = self._spans
        spans.append((cid, a, c))
        self._calls[cid] += 1
        if b is not a:
            spans.append((rid, a, b))
            self._calls[rid] += 1
        spans.append((tid, b, c))
        self._calls[tid] += 1
        self._calls[eid] += 1
        self._host_ns[eid] += fn_ns
        self._self_ns += time.perf_counter_ns() - t_in - fn_ns - rdv_ns
        return out
