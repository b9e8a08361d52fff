"""``Profiler``: where step time goes, per section, per collective part, across ranks.

Hot path (inside a step): ``section`` enter/exit, ``collective`` and its wrappers take
a timestamp token, append it to this step's span list and count the call; nothing
waits for the device (except in the opt-in ``collectives``/``sync`` modes) and nothing
crosses ranks except the 1-element rendezvous all_reduce the caller asked for.
Cold path: ``end_step`` turns the *previous* step's tokens into times; ``report``
gathers one summary object per rank and builds the table and the step records.

The class is put together from parts, one module each: span recording (sections,
collectives, misuse: :mod:`syncless.profile.spans`), module forwards
(:mod:`syncless.profile.module_hooks`) and the collective wrappers
(:mod:`syncless.profile.wrappers`). This module holds setup, steps and reports.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from syncless.profile import report as _report
from syncless.profile import summary as _summary
from syncless.profile.calibrate import Calibration, calibrate
from syncless.profile.module_hooks import ModuleHandle, ModuleHooks
from syncless.profile.spans import ProfileMisuse, SpanRecorder, _Span
from syncless.profile.table import DISTORTION, render
from syncless.profile.timers import make_timer
from syncless.profile.wrappers import CollectiveWrappers
from syncless.run.console import print_wide

# ModuleHandle and ProfileMisuse are defined next door; importable from here too.
__all__ = ["MODES", "ModuleHandle", "ProfileMisuse", "Profiler"]

MODES = ("off", "events", "collectives", "sync")


class Profiler(SpanRecorder, ModuleHooks, CollectiveWrappers):
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
