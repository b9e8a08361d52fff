"""What one rank records: sections, collectives and module forwards as spans of timer
tokens, in steps.

:class:`SpanRecorder` is the recording half of
:class:`~syncless.profile.profiler.Profiler`, which owns one (the other half, setup
and the cross-rank report, is the profiler's own). Entering and leaving a section, and
each collective, take a timestamp token from the timer, append ``(section id, start
token, end token)`` to this step's span list and count the call; nothing waits for the
device (except in the opt-in ``collectives``/``sync`` modes) and nothing crosses ranks
except the 1-element rendezvous all_reduce the caller asked for. A section gets its id
at its first use (interning). At the end of a step the *previous* step's tokens are
turned into times (lagged timers). Misuse inside a step is counted, or raised as
:class:`ProfileMisuse` with ``strict=True``. A span captured into a CUDA graph goes to
:class:`~syncless.profile.graph_sections.GraphSections` instead, which times its replays.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from syncless.hot_path import hot_path
from syncless.profile import names as _names
from syncless.profile import summary as _summary
from syncless.profile.graph_sections import GraphMark, GraphSections
from syncless.profile.module_hooks import ModuleHandle
from syncless.profile.timers import Timer

__all__ = ["ProfileMisuse", "Span", "SpanRecorder"]

F = TypeVar("F", bound=Callable[..., Any])


class ProfileMisuse(RuntimeError):
    """Raised for in-step misuse only with ``strict=True``; otherwise it is counted."""


class Span:
    """The context manager ``Profiler.section`` returns (one small object per call)."""

    __slots__ = ("_bytes", "_prof", "_sid", "_token")

    def __init__(self, prof: SpanRecorder, sid: int, nbytes: int) -> None:
        self._prof = prof
        self._sid = sid
        self._bytes = nbytes
        self._token: Any = None

    @hot_path
    def __enter__(self) -> Span:
        self._prof.open_span(self)
        return self

    @hot_path
    def __exit__(self, *exc: object) -> None:
        self._prof.close_span(self)


class SpanRecorder:
    """Sections, collectives, module forwards and steps of one rank, timed by ``timer``.

    Args:
        timer: the clock (:mod:`syncless.profile.timers`); tests swap in their own.
        strict: raise :class:`ProfileMisuse` on misuse instead of counting it.
        nvtx: also push/pop NVTX ranges per section (CUDA only).
        sync_collectives: drain the device around collective spans (``collectives``
            mode on CUDA).
        group: the default process group of ``collective``'s rendezvous.
        graphs: the spans captured into CUDA graphs (the one ``timer`` marks them in).
    """

    def __init__(
        self,
        timer: Timer,
        *,
        strict: bool,
        nvtx: bool,
        sync_collectives: bool,
        group: dist.ProcessGroup | None,
        graphs: GraphSections,
    ) -> None:
        self.graphs = graphs
        self.use_timer(timer)
        self.strict = strict
        self.nvtx = nvtx
        self._sync_collectives = sync_collectives
        self._group = group
        # The rendezvous payload, fixed once the process group is known (use_rendezvous).
        self._rdv: torch.Tensor | None = None
        # Sections, interned on first use (warm-up): name -> id, and per-id metadata.
        self._ids: dict[tuple[str, str], int] = {}
        self._coll: dict[str, tuple[int, int, int, int]] = {}
        self._meta: list[_summary.SectionTotals] = []
        self._calls: list[int] = []
        self._bytes: list[int] = []
        self._host_ns: list[int] = []  # host-measured times (enqueue), added directly
        self._time_ns: list[float] = []  # resolved device/host span times, this window
        self._seen: list[bool] = []  # reported once: keep its row (stable record names)
        self._by_name: dict[str, int] = {}  # raw name -> id, for end_section(name)
        self._step_sid = self._intern("step", "step", "compute", None)
        # Per-step hot state.
        self.in_step = False
        self._step: int | None = None
        self._step_token: Any = None
        self._stack: list[Span] = []
        self._spans: list[tuple[int, Any, Any]] = []
        self.self_ns = 0  # the instruments' own host time, this window
        self._misuse = 0
        self._warned: set[str] = set()
        # Lagged steps whose tokens are not read yet: (span list, last token).
        self._pending: list[tuple[list[tuple[int, Any, Any]], Any]] = []
        # Report window.
        self.window_steps = 0
        self.steps_total = 0
        self.last_step = -1

    def use_timer(self, timer: Timer) -> None:
        """Time spans with ``timer`` from now on; its captured spans go to ``graphs``."""
        self.timer = timer
        if hasattr(timer, "graphs"):
            timer.graphs = self.graphs

    def use_rendezvous(self, rdv: torch.Tensor | None) -> None:
        """The 1-element tensor ``collective`` all_reduces before each collective (None:
        not distributed, no rendezvous)."""
        self._rdv = rdv

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

    def section_id(self, name: str, category: str) -> int:
        key = (name, category)
        sid = self._ids.get(key)
        if sid is None:
            if category not in _names.CATEGORIES:
                self.misused(
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

    def misused(self, key: str, message: str) -> None:
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
    def section(self, name: str, category: str = "compute", bytes: int = 0) -> Span:
        """A span: ``with prof.section("attn"):``. ``bytes`` per call gives GB/s.

        Nesting is allowed; the same name under two parents shares one row.
        """
        return Span(self, self.section_id(name, category), bytes)

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
        self.open_span(Span(self, self.section_id(name, category), bytes))

    @hot_path
    def end_section(self, name: str) -> None:
        """Close the innermost open section called ``name``."""
        if self.in_step:  # else its begin was counted already (outside a step)
            self._close_innermost(
                self._by_name.get(name, -1),
                f"end_section({name!r}): section {name!r} is not open",
            )

    def _close_innermost(self, sid: int, not_open: str) -> None:
        """Close the innermost open span of section ``sid`` (misuse if there is none)."""
        for span in reversed(self._stack):
            if span._sid == sid:
                self.close_span(span)
                return
        self.misused("not-open", not_open)

    @hot_path
    def open_span(self, span: Span) -> None:
        t_in = time.perf_counter_ns()
        if not self.in_step:
            self.misused("outside", "a section was entered outside a step; not timed")
            return
        if self.nvtx:
            torch.cuda.nvtx.range_push(self._meta[span._sid].name)
        self._stack.append(span)
        span._token = self.timer.mark()
        self.self_ns += time.perf_counter_ns() - t_in

    @hot_path
    def close_span(self, span: Span) -> None:
        t_in = time.perf_counter_ns()
        if span._token is None:
            return  # entered outside a step: already counted at entry
        end = self.timer.mark_end(span._token)
        stack = self._stack
        if not stack or stack[-1] is not span:
            name = self._meta[span._sid].name
            if span not in stack:
                self.misused("not-open", f"section {name!r} ended but it is not open")
                span._token = None
                return
            # Ended out of order: drop the sections opened inside it and still open.
            self.misused("nesting", f"section {name!r} ended before the sections inside it")
            while stack[-1] is not span:
                stack.pop()
                if self.nvtx:
                    torch.cuda.nvtx.range_pop()  # keep the NVTX stack balanced
        stack.pop()
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        sid = span._sid
        if end.__class__ is GraphMark:  # captured: timed at the graph's replays
            self._captured(sid, end, span._bytes)
        else:
            self._spans.append((sid, span._token, end))
            self._calls[sid] += 1
            self._bytes[sid] += span._bytes
        span._token = None
        self.self_ns += time.perf_counter_ns() - t_in

    # -- collectives (hot) ------------------------------------------------------------

    @hot_path
    def collective(
        self, name: str, fn: Callable[..., Any], *args: Any, rendezvous: bool = True, **kw: Any
    ) -> Any:
        """``Profiler.collective``'s recording (its docstring says what is timed)."""
        t_in = time.perf_counter_ns()
        if not self.in_step:
            self.misused("coll-outside", f"collective {name!r} outside a step; not timed")
            return fn(*args, **kw)
        cid, eid, rid, tid = self._collective_ids(name)
        timer = self.timer
        # A synchronize inside a CUDA graph capture would fail it.
        sync = self._sync_collectives and not self.graphs.capturing()
        if sync:
            torch.cuda.synchronize()  # syncless: ok opt-in collectives mode
        a = timer.mark()
        if a.__class__ is GraphMark:
            return self._captured_collective(cid, tid, a, t_in, fn, *args, **kw)
        rdv_ns = 0
        b = a
        if rendezvous and self._rdv is not None:
            r0 = time.perf_counter_ns()
            group = kw.get("group", self._group)
            # The rendezvous probe: its wait is the skew measurement the caller asked for.
            dist.all_reduce(self._rdv, group=group)  # syncless: collective-ok skew probe
            rdv_ns = time.perf_counter_ns() - r0
            b = timer.mark()
        h0 = time.perf_counter_ns()
        out = fn(*args, **kw)
        fn_ns = time.perf_counter_ns() - h0
        if sync:
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
        self.self_ns += time.perf_counter_ns() - t_in - fn_ns - rdv_ns
        return out

    def _captured_collective(
        self, cid: int, tid: int, start: GraphMark, t_in: int, fn: Callable[..., Any],
        *args: Any, **kw: Any,
    ) -> Any:  # fmt: skip
        """A collective issued while its stream is captured into a CUDA graph: the
        collective and its transfer are one device span, timed at every replay. No
        rendezvous probe: it would add a collective to every replay of the caller's
        graph. No enqueue: the host ran the call once, at capture."""
        h0 = time.perf_counter_ns()
        out = fn(*args, **kw)
        fn_ns = time.perf_counter_ns() - h0
        end = self.timer.mark_end(start)
        self._captured(cid, end, 0)
        if end.base >= 0:  # (an untimed one is named once, as the collective)
            self._captured(tid, end, 0)
        self.self_ns += time.perf_counter_ns() - t_in - fn_ns
        return out

    def _captured(self, sid: int, end: GraphMark, nbytes: int) -> None:
        """A span of section ``sid`` closed inside a captured region (Python runs once,
        at capture): its row is kept from now on, timed or not."""
        self._seen[sid] = True
        self.graphs.add(sid, self._meta[sid].name, end, nbytes)

    # -- module forwards (hot) -------------------------------------------------------

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
        span = Span(self, self._ids.get((name, category), -1), bytes)
        clock = time.perf_counter_ns
        mark, mark_end = self.timer.mark, self.timer.mark_end
        stack = self._stack  # cleared in place, never replaced
        calls, sizes = self._calls, self._bytes
        graph_mark = GraphMark
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
            if span._sid < 0 or span._token is not None or not self.in_step or self.nvtx:
                self._open_slow(span, name, category, bytes)
            else:
                stack.append(span)
                span._token = mark()
                self.self_ns += clock() - t_in
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
                    if end.__class__ is graph_mark:  # captured: timed at replays
                        self._captured(sid, end, bytes)
                    else:
                        self._spans.append((sid, token, end))
                        calls[sid] += 1
                        if bytes:
                            sizes[sid] += bytes
                    span._token = None
                    self.self_ns += clock() - t_in

        module.forward = timed_forward  # type: ignore[method-assign]
        return [ModuleHandle(module, timed_forward, previous)]

    def _open_slow(self, span: Span, name: str, category: str, nbytes: int) -> None:
        """``hook_module``'s open when its short path does not apply."""
        if span._token is not None:  # the module re-entered itself: a span of its own
            self.begin_section(name, category, nbytes)
            return
        span._sid = self.section_id(name, category)  # interned at the first call
        self.open_span(span)

    def _close_slow(self, span: Span) -> None:
        """``hook_module``'s close when its short path does not apply: close the
        innermost open span of the section (a re-entered call's own span, or ``span``
        with whatever was left open inside it)."""
        if self.in_step:  # else, as end_section: its begin was counted already
            name = self._meta[span._sid].name if span._sid >= 0 else "?"
            self._close_innermost(span._sid, f"module section {name!r} ended but it is not open")

    # -- steps ------------------------------------------------------------------------

    def begin_step(self, step: int | None, t_in: int) -> None:
        """Open step ``step`` (default: one more than the last); ``t_in`` is when the
        caller's ``begin_step`` started, billed to the instruments."""
        if self.in_step:
            self.misused("begin", "begin_step() while a step is open; the open step is ended")
            self.end_step()
        self._step = self.last_step + 1 if step is None else step
        self.in_step = True
        self._step_token = self.timer.mark()
        self.self_ns += time.perf_counter_ns() - t_in

    def end_step(self) -> None:
        """Close the open step and read the previous step's device times (lagged), and
        the stamps of the graphs replayed since the last step (lagged too)."""
        t_in = time.perf_counter_ns()
        if not self.in_step:
            self.misused("end", "end_step() without an open step; ignored")
            return
        if self.graphs.capturing():
            self._drop_captured_end()
            return
        if self._stack:
            names = [self._meta[s._sid].name for s in self._stack]
            self.misused("open-at-end", f"step ended with sections still open: {names}")
            if self.nvtx:
                for _ in self._stack:
                    torch.cuda.nvtx.range_pop()  # keep the NVTX stack balanced
            self._stack.clear()  # their spans are dropped: they have no end
        end = self.timer.mark_end(self._step_token)
        self._spans.append((self._step_sid, self._step_token, end))
        self._calls[self._step_sid] += 1
        self.in_step = False
        self.last_step = self._step if self._step is not None else self.last_step + 1
        self._resolve_pending()  # the previous step's tokens (lagged timers)
        self._pending.append((self._spans, end))
        self._spans = []
        if not self.timer.lagged:
            self._resolve_pending()
        self.timer.swap()
        self._add_replays(self.graphs.end_step())
        self.window_steps += 1
        self.steps_total += 1
        self.self_ns += time.perf_counter_ns() - t_in

    def _drop_captured_end(self) -> None:
        """``end_step`` inside a capture: no wait, no copy there (either would go into
        the graph or fail it), so the step is dropped."""
        self.misused(
            "end-captured",
            "end_step() inside a CUDA graph capture: the step is dropped (end the step "
            "after the captured region)",
        )
        if self.nvtx:
            for _ in self._stack:
                torch.cuda.nvtx.range_pop()  # keep the NVTX stack balanced
        self._stack.clear()
        self._spans = []
        self.in_step = False

    def _resolve_pending(self) -> None:
        timer = self.timer
        for spans, last in self._pending:
            timer.wait(last)
            for sid, a, b in spans:
                self._time_ns[sid] += timer.elapsed_ns(a, b)
        self._pending.clear()

    def _add_replays(self, replayed: list[tuple[int, float, int, int]]) -> None:
        """Captured sections' time, calls and bytes from the graphs' replays."""
        for sid, ns, calls, nbytes in replayed:
            self._time_ns[sid] += ns
            self._calls[sid] += calls
            self._bytes[sid] += nbytes

    # -- the report window (cold) -------------------------------------------------------

    def summary(self, rank: int) -> _summary.RankSummary:
        """This rank's totals for the current window (reads any lagged events and
        graph stamps)."""
        self._resolve_pending()
        self._add_replays(self.graphs.drain())
        sections: dict[str, _summary.SectionTotals] = {}
        for sid, meta in enumerate(self._meta):
            if sid == self._step_sid:
                continue
            t = self._time_ns[sid] + self._host_ns[sid]
            if self._calls[sid] == 0 and not self._seen[sid]:
                continue  # e.g. the rendezvous part of a collective that never uses one
            self._seen[sid] = True
            sections[meta.name] = _summary.SectionTotals(
                meta.name,
                meta.category,
                meta.kind,
                meta.parent,
                t,
                self._calls[sid],
                self._bytes[sid],
            )
        step = _summary.SectionTotals(
            "step", "step", "step", None, self._time_ns[self._step_sid], self.window_steps
        )
        return _summary.RankSummary(
            rank=rank,
            steps=self.window_steps,
            step_ns=self._time_ns[self._step_sid],
            self_ns=float(self.self_ns),
            misuse=self._misuse,
            sections={"step": step, **sections},
            untimed_graph_spans=self.graphs.untimed,
        )

    def reset_window(self) -> None:
        """Start the next report window: every per-section total back to zero."""
        n = len(self._meta)
        # In place: hook_module's wrappers hold these lists.
        self._time_ns[:] = [0.0] * n
        self._calls[:] = [0] * n
        self._bytes[:] = [0] * n
        self._host_ns[:] = [0] * n
        self.window_steps = 0
        self.self_ns = 0
        self._misuse = 0
