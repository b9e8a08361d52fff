"""``Profiler``: where step time goes, per section, per collective part, across ranks.

Hot path (inside a step): ``section`` enter/exit, ``collective`` and its wrappers take
a timestamp token, append it to this step's span list and count the call; nothing
waits for the device (except in the opt-in ``collectives``/``sync`` modes) and nothing
crosses ranks except the 1-element rendezvous all_reduce the caller asked for.
Cold path: ``end_step`` turns the *previous* step's tokens into times; ``report``
gathers one summary object per rank and builds the table and the step records.
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from syncless.hot_path import hot_path
from syncless.profile import names as _names
from syncless.profile import report as _report
from syncless.profile import summary as _summary
from syncless.profile.calibrate import Calibration, calibrate
from syncless.profile.table import DISTORTION, render
from syncless.profile.timers import make_timer
from syncless.profile.wrappers import CollectiveWrappers
from syncless.run.console import print_wide

MODES = ("off", "events", "collectives", "sync")
F = TypeVar("F", bound=Callable[..., Any])


class ProfileMisuse(RuntimeError):
    """Raised for in-step misuse only with ``strict=True``; otherwise it is counted."""


class _Span:
    """The context manager ``Profiler.section`` returns (one small object per call)."""

    __slots__ = ("_bytes", "_prof", "_sid", "_token")

    def __init__(self, prof: Profiler, sid: int, nbytes: int) -> None:
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


class Profiler(CollectiveWrappers):
    """Section profiler for training steps. ``Profiler(mode="off")`` is the shared no-op.

    Args:
        mode: ``events`` (default), ``collectives``, ``sync`` or ``off``; see
            docs/profile.md for what each one distorts.
        group: process group for rendezvous all_reduces and the report gather
            (default: the world group when torch.distributed is initialised).
        report_every: ``report()`` gathers and returns a report once per this many
            completed steps and returns ``None`` in between. Every rank must call it at
            the same points: it is a collective.
        strict: raise ``ProfileMisuse`` on in-step misuse instead of counting it.
        nvtx: also push/pop NVTX ranges per section (CUDA only).
        cuda: time with CUDA events (default: ``torch.cuda.is_available()``).
        run_name: the ``run`` field of the returned StepRecords.
        calibrate: measure the instruments' own costs at the first step (a collective
            when distributed); ``False`` skips it.
        console: where ``report(print_table=True)`` prints.
    """

    def __new__(cls, mode: str | None = None, *args: Any, **kwargs: Any) -> Any:
        if mode == "off":
            from syncless.profile.off import OFF

            return OFF  # not a Profiler instance, so __init__ is skipped
        return super().__new__(cls)

    def __init__(
        self,
        mode: str | None = None,
        group: dist.ProcessGroup | None = None,
        report_every: int = 10,
        *,
        strict: bool = False,
        nvtx: bool = False,
        cuda: bool | None = None,
        run_name: str = "run",
        calibrate: bool = True,
        console: Console | None = None,
    ) -> None:
        mode = "events" if mode is None else mode
        if mode not in MODES:
            raise ValueError(f"unknown profiler mode {mode!r}; expected one of {MODES}")
        if not isinstance(report_every, int) or report_every < 1:
            raise ValueError(f"report_every must be a positive int, got {report_every!r}")
        self.mode = mode
        self.group = group
        self.report_every = report_every
        self.strict = strict
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.nvtx = nvtx and self.cuda
        self.run_name = run_name
        self.console = console
        self._want_calibration = calibrate
        self.calibration: Calibration | None = None
        self._timer = make_timer(mode, self.cuda)
        # Collectives mode drains the device around collective spans only.
        self._sync_collectives = self.cuda and mode == "collectives"
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
        self._in_step = False
        self._step: int | None = None
        self._step_token: Any = None
        self._stack: list[_Span] = []
        self._spans: list[tuple[int, Any, Any]] = []
        self._self_ns = 0
        self._misuse = 0
        self._warned: set[str] = set()
        # Lagged steps whose tokens are not read yet: (span list, last token).
        self._pending: list[tuple[list[tuple[int, Any, Any]], Any]] = []
        # Report window.
        self._w_steps = 0
        self._steps_total = 0
        self._last_step = -1
        # Distributed setup is lazy: the profiler may be built before init_process_group.
        self._dist_ready = False
        self._world = 1
        self._rank = 0
        self._rdv: torch.Tensor | None = None

    # -- setup (cold) ---------------------------------------------------------------

    def _setup(self) -> None:
        self._dist_ready = True
        if dist.is_available() and dist.is_initialized():
            self._world = dist.get_world_size(self.group)
            self._rank = dist.get_rank(self.group)
            backend = dist.get_backend(self.group)
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if self.cuda and backend != "gloo"
                else torch.device("cpu")
            )
            # The rendezvous payload: fixed at setup, never read on the host.
            self._rdv = torch.zeros(1, device=device)
        if self._want_calibration:
            self._want_calibration = False
            self.calibrate()

    def calibrate(self) -> Calibration:
        """Measure the instruments (a collective when distributed: call it on every rank).

        Runs by itself at the first step unless ``calibrate=False`` was given.
        """
        if not self._dist_ready:
            self._want_calibration = False
            self._setup()
        self.calibration = calibrate(self.cuda, self.group, self._rdv)
        return self.calibration

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

    # -- steps ----------------------------------------------------------------------

    def begin_step(self, step: int | None = None) -> None:
        """Open step ``step`` (default: one more than the last)."""
        t_in = time.perf_counter_ns()
        if not self._dist_ready:
            self._setup()
            t_in = time.perf_counter_ns()  # calibration is billed to nobody's step
        if self._in_step:
            self._misused("begin", "begin_step() while a step is open; the open step is ended")
            self.end_step()
        self._step = self._last_step + 1 if step is None else step
        self._in_step = True
        self._step_token = self._timer.mark()
        self._self_ns += time.perf_counter_ns() - t_in

    def end_step(self) -> None:
        """Close the open step and read the previous step's device times (lagged)."""
        t_in = time.perf_counter_ns()
        if not self._in_step:
            self._misused("end", "end_step() without an open step; ignored")
            return
        if self._stack:
            names = [self._meta[s._sid].name for s in self._stack]
            self._misused("open-at-end", f"step ended with sections still open: {names}")
            if self.nvtx:
                for _ in self._stack:
                    torch.cuda.nvtx.range_pop()  # keep the NVTX stack balanced
            self._stack.clear()  # their spans are dropped: they have no end
        end = self._timer.mark_end(self._step_token)
        self._spans.append((self._step_sid, self._step_token, end))
        self._calls[self._step_sid] += 1
        self._in_step = False
        self._last_step = self._step if self._step is not None else self._last_step + 1
        self._resolve_pending()  # the previous step's tokens (lagged timers)
        self._pending.append((self._spans, end))
        self._spans = []
        if not self._timer.lagged:
            self._resolve_pending()
        self._timer.swap()
        self._w_steps += 1
        self._steps_total += 1
        self._self_ns += time.perf_counter_ns() - t_in

    def step(self, step: int | None = None) -> _StepContext:
        """``with prof.step(n):`` = ``begin_step(n)`` ... ``end_step()``."""
        return _StepContext(self, step)

    def _resolve_pending(self) -> None:
        timer = self._timer
        for spans, last in self._pending:
            timer.wait(last)
            for sid, a, b in spans:
                self._time_ns[sid] += timer.elapsed_ns(a, b)
        self._pending.clear()

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

    # -- report (cold, collective) ------------------------------------------------------

    def summary(self) -> _summary.RankSummary:
        """This rank's totals for the current window (reads any lagged events)."""
        self._resolve_pending()
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
            "step", "step", "step", None, self._time_ns[self._step_sid], self._w_steps
        )
        return _summary.RankSummary(
            rank=self._rank,
            steps=self._w_steps,
            step_ns=self._time_ns[self._step_sid],
            self_ns=float(self._self_ns),
            misuse=self._misuse,
            sections={"step": step, **sections},
        )

    def report(
        self, step: int | None = None, *, force: bool = False, print_table: bool = False
    ) -> _report.ProfileReport | None:
        """Every ``report_every`` steps: gather once across ranks, return the report.

        Returns ``None`` between reports. A collective when distributed: every rank
        must call it at the same points. ``force=True`` reports whatever the window
        holds. Raises ``ValueError`` if no step was ever completed (a setup bug).
        """
        if self._in_step:
            self._misused("report-in-step", "report() inside an open step; skipped")
            return None
        if self._steps_total == 0:
            raise ValueError(
                "Profiler.report() before any completed step: wrap the training step in "
                "`with prof.step(n):` (or begin_step()/end_step()) first"
            )
        if self._w_steps == 0 or (not force and self._w_steps < self.report_every):
            return None
        mine = self.summary()
        if self._world > 1:
            gathered: list[Any] = [None] * self._world
            # Cold path: the one gather per report.
            dist.all_gather_object(gathered, mine, group=self.group)
            summaries: list[_summary.RankSummary] = gathered
        else:
            summaries = [mine]
        idx = next(i for i, s in enumerate(summaries) if s.rank == self._rank)
        rows = _summary.rows(summaries, idx)
        lates = _summary.late_ranks(summaries)
        at = self._last_step if step is None else step
        key = "events-cpu" if self.mode == "events" and not self.cuda else self.mode
        table = render(
            f"profile: {mine.steps} step(s) to step {at}, rank {self._rank} of "
            f"{self._world}, mode {self.mode}",
            rows,
            lates,
            DISTORTION[key],
            self.calibration,
        )
        vals = _report.values(mine, rows, lates)
        rep = _report.ProfileReport(
            step=at,
            steps=mine.steps,
            rows=rows,
            lates=lates,
            table=table,
            values=vals,
            records=_report.records(self.run_name, at, self._rank, vals),
        )
        self._reset_window()
        if print_table:
            print_wide(self.console or Console(file=sys.stdout), table)
        return rep

    def _reset_window(self) -> None:
        n = len(self._meta)
        # In place: hook_module's wrappers hold these lists.
        self._time_ns[:] = [0.0] * n
        self._calls[:] = [0] * n
        self._bytes[:] = [0] * n
        self._host_ns[:] = [0] * n
        self._w_steps = 0
        self._self_ns = 0
        self._misuse = 0


class _StepContext:
    __slots__ = ("_prof", "_step")

    def __init__(self, prof: Profiler, step: int | None) -> None:
        self._prof = prof
        self._step = step

    def __enter__(self) -> Profiler:
        self._prof.begin_step(self._step)
        return self._prof

    def __exit__(self, *exc: object) -> None:
        self._prof.end_step()
