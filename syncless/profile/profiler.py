"""``Profiler``: where step time goes, per section, per collective part, across ranks.

Hot path (inside a step): ``section`` enter/exit, ``collective`` and its wrappers take
a timestamp token, append it to this step's span list and count the call; nothing
waits for the device (except in the opt-in ``collectives``/``sync`` modes) and nothing
crosses ranks except the 1-element rendezvous all_reduce the caller asked for.
Cold path: ``end_step`` turns the *previous* step's tokens into times; ``report``
gathers one summary object per rank and builds the table and the step records.

The profiler owns a :class:`~syncless.profile.spans.SpanRecorder`, which records this
rank's sections, collectives, module forwards and steps; the profiler holds the
settings, the distributed setup, the calibration and the cross-rank report.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from syncless.hot_path import hot_path
from syncless.profile import collective_calls
from syncless.profile import report as _report
from syncless.profile import stragglers as _stragglers
from syncless.profile import summary as _summary
from syncless.profile.calibrate import Calibration, calibrate
from syncless.profile.gpu_sensors import GpuSensors
from syncless.profile.graph_sections import UNTIMED_RECORD, GraphSections
from syncless.profile.module_hooks import ModuleHandle
from syncless.profile.spans import ProfileMisuse, Span, SpanRecorder
from syncless.profile.stragglers import StepTimes, StragglerConfig, StragglerDetector, Verdict
from syncless.profile.table import DISTORTION, graph_notes, render
from syncless.profile.timers import Timer, make_timer
from syncless.run.console import print_wide
from syncless.run.dist import location

# ModuleHandle and ProfileMisuse are defined next door; importable from here too.
__all__ = ["MODES", "ModuleHandle", "ProfileMisuse", "Profiler"]

MODES = ("off", "events", "collectives", "sync")

F = TypeVar("F", bound=Callable[..., Any])


class Profiler:
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
        stragglers: score every report's sections against the fleet
            (:class:`~syncless.profile.stragglers.StragglerConfig`; ``False``: off).
            Verdicts are in ``ProfileReport.stragglers`` and its records; see
            docs/stragglers.md. On CUDA, GPU sensors are sampled through NVML too.
        on_straggler: called with each :class:`~syncless.profile.stragglers.Verdict`
            once, when it opens, on every rank (every rank gathers every summary).
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
        stragglers: StragglerConfig | bool = True,
        on_straggler: Callable[[Verdict], None] | None = None,
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
        graphs = GraphSections(self.cuda)
        self._recorder = SpanRecorder(
            make_timer(mode, self.cuda, graphs),
            strict=strict,
            nvtx=self.nvtx,
            # Collectives mode drains the device around collective spans only.
            sync_collectives=self.cuda and mode == "collectives",
            group=group,
            graphs=graphs,
        )
        # Distributed setup is lazy: the profiler may be built before init_process_group.
        self._dist_ready = False
        self._world = 1
        self._rank = 0
        self._rdv: torch.Tensor | None = None
        if stragglers is False:
            self._stragglers: StragglerDetector | None = None
        else:
            config = stragglers if isinstance(stragglers, StragglerConfig) else None
            self._stragglers = StragglerDetector(config, on_straggler)
        # NVML sensors, sampled on a thread (syncless.profile.gpu_sensors): started at
        # setup on CUDA when stragglers are scored.
        self._sensors: Any = None
        self._where = ("", "")  # (host, device) of this rank, found at setup
        # Per-step section times of the window: stragglers score their medians.
        self._step_times = StepTimes() if self._stragglers is not None else None

    @property
    def _timer(self) -> Timer:
        """The recorder's clock (tests and benches swap in their own)."""
        return self._recorder.timer

    @_timer.setter
    def _timer(self, timer: Timer) -> None:
        self._recorder.use_timer(timer)

    @property
    def _graphs(self) -> GraphSections:
        """The spans captured into CUDA graphs (tests give it a stand-in clock)."""
        return self._recorder.graphs

    # -- setup (cold) ---------------------------------------------------------------

    def _setup(self) -> None:
        self._dist_ready = True
        self._recorder.graphs.setup()  # CUDA: the stamp buffer and kernels, before any capture
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
            self._recorder.use_rendezvous(self._rdv)
        if self._want_calibration:
            self._want_calibration = False
            self.calibrate()
        self._where = location(self.cuda)
        if self.cuda and self._stragglers is not None and self._sensors is None:
            self._sensors = GpuSensors.start(torch.cuda.current_device())

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
        recorder = self._recorder
        if recorder.graphs.capturing():  # its setup, its waits: none may go into a graph
            recorder.misused(
                "begin-captured",
                "begin_step() inside a CUDA graph capture: not a step (begin the step "
                "before the captured region)",
            )
            return
        if not self._dist_ready:
            self._setup()
            t_in = time.perf_counter_ns()  # calibration is billed to nobody's step
        recorder.begin_step(step, t_in)

    def end_step(self) -> None:
        """Close the open step and read the previous step's device times (lagged)."""
        recorder = self._recorder
        recorder.end_step()
        if self._step_times is not None and self._world > 1:  # cold: host lists only
            t_in = time.perf_counter_ns()
            self._step_times.take(recorder._time_ns, recorder._step_sid)
            recorder.self_ns += time.perf_counter_ns() - t_in

    def step(self, step: int | None = None) -> _StepContext:
        """``with prof.step(n):`` = ``begin_step(n)`` ... ``end_step()``."""
        return _StepContext(self, step)

    # -- sections, collectives, module forwards (hot: the recorder's) --------------------

    @hot_path
    def section(self, name: str, category: str = "compute", bytes: int = 0) -> Span:
        """A span: ``with prof.section("attn"):``. ``bytes`` per call gives GB/s.

        Nesting is allowed; the same name under two parents shares one row.
        """
        recorder = self._recorder  # no frame of its own: a frame per span is host time
        return Span(recorder, recorder.section_id(name, category), bytes)

    def section_fn(self, name: str | None = None, category: str = "compute") -> Callable[[F], F]:
        """Decorator: run the function inside ``section(name or fn.__name__)``."""
        return self._recorder.section_fn(name, category)

    @hot_path
    def begin_section(self, name: str, category: str = "compute", bytes: int = 0) -> None:
        """Open a section without a ``with`` block; close it with ``end_section(name)``."""
        recorder = self._recorder
        recorder.open_span(Span(recorder, recorder.section_id(name, category), bytes))

    @hot_path
    def end_section(self, name: str) -> None:
        """Close the innermost open section called ``name``."""
        self._recorder.end_section(name)

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
        return self._recorder.collective(name, fn, *args, rendezvous=rendezvous, **kw)

    # Each ``dist`` call through ``collective``, the group defaulting to the profiler's.
    all_reduce = collective_calls.all_reduce
    all_to_all_single = collective_calls.all_to_all_single
    all_gather_into_tensor = collective_calls.all_gather_into_tensor

    def hook_module(
        self, module: nn.Module, name: str, category: str = "compute", bytes: int = 0
    ) -> list[ModuleHandle]:
        """Time every forward of ``module`` as section ``name``; see
        :meth:`SpanRecorder.hook_module <syncless.profile.spans.SpanRecorder.hook_module>`.
        Returns a handle; ``remove()`` puts ``forward`` back."""
        return self._recorder.hook_module(module, name, category, bytes)

    # -- report (cold, collective) ------------------------------------------------------

    def summary(self) -> _summary.RankSummary:
        """This rank's totals for the current window (reads any lagged events), with
        its GPU sensors over the window where NVML samples them."""
        recorder = self._recorder
        mine = recorder.summary(self._rank)
        if self._step_times is not None and self._world > 1:  # its last step, read now
            self._step_times.take(recorder._time_ns, recorder._step_sid)
            mine.step_medians = self._step_times.medians(recorder._meta)
        if self._sensors is not None:
            mine.sensors = self._sensors.summary()
        mine.host, mine.device = self._where
        return mine

    def report(
        self, step: int | None = None, *, force: bool = False, print_table: bool = False
    ) -> _report.ProfileReport | None:
        """Every ``report_every`` steps: gather once across ranks, return the report.

        Returns ``None`` between reports. A collective when distributed: every rank
        must call it at the same points. ``force=True`` reports whatever the window
        holds. Raises ``ValueError`` if no step was ever completed (a setup bug).
        """
        recorder = self._recorder
        if recorder.in_step:
            recorder.misused("report-in-step", "report() inside an open step; skipped")
            return None
        if recorder.steps_total == 0:
            raise ValueError(
                "Profiler.report() before any completed step: wrap the training step in "
                "`with prof.step(n):` (or begin_step()/end_step()) first"
            )
        if recorder.window_steps == 0 or (not force and recorder.window_steps < self.report_every):
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
        at = recorder.last_step if step is None else step
        key = "events-cpu" if self.mode == "events" and not self.cuda else self.mode
        table = render(
            f"profile: {mine.steps} step(s) to step {at}, rank {self._rank} of "
            f"{self._world}, mode {self.mode}",
            rows,
            lates,
            DISTORTION[key],
            self.calibration,
            graph_notes(recorder.graphs.timed, mine.untimed_graph_spans, UNTIMED_RECORD),
        )
        vals = _report.values(mine, rows, lates)
        verdicts: list[Verdict] = []
        if self._stragglers is not None:
            # Cold path: numpy over the summaries gathered above, no collective.
            fleet = _stragglers.fleet(summaries)
            verdicts = self._stragglers.update(fleet, at - mine.steps + 1, at)
            lead = self._rank == min(s.rank for s in summaries)
            vals |= _report.straggler_values(self._stragglers, verdicts, self._rank, lead)
        rep = _report.ProfileReport(
            step=at,
            steps=mine.steps,
            rows=rows,
            lates=lates,
            table=table,
            values=vals,
            records=_report.records(self.run_name, at, self._rank, vals),
            stragglers=verdicts,
        )
        recorder.reset_window()
        if self._step_times is not None:
            self._step_times.reset()
        if print_table:
            print_wide(self.console or Console(file=sys.stdout), table)
        return rep


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
