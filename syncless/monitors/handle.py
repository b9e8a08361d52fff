"""``MonitorHandle``: what :func:`~syncless.monitors.attach` returns; it flushes the
monitors once per step, reads them back lagged, and bills their cost."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from syncless.errors import UsageError
from syncless.graphs import capturing
from syncless.metrics import Landed, Readout
from syncless.monitors.alarm import Action, NonFiniteAlarm
from syncless.monitors.attribution import Attribution
from syncless.monitors.base import AREA, Monitor, MonitorContext
from syncless.monitors.nonfinite import CHECKED_VALUES, NonFiniteMonitor
from syncless.monitors.silence import SilentMonitors
from syncless.run import Run, StepRecord, check_metric_name
from syncless.run.records import StepRecords

#: The longest the readout thread waits for a backward to start before it reads anyway.
READOUT_WAIT_S = 2.0
#: Step labels kept where the device's guess (the previous label + 1) was not the one
#: ``step`` got (a resumed run's first step, steps numbered in strides).
RELABELS_KEPT = 64
#: What closed handles whose hooks a CUDA graph captured leave behind: a graph that is
#: still replayed reads their tables and writes their buffer (with every gate off, its
#: kernels return early), so that memory must never be freed and reused.
_KEPT_FOR_GRAPHS: list[object] = []


class MonitorHandle:
    """What ``attach`` returns: call ``step(step)`` once per training step, ``close()``
    at the end.

    ``step`` flushes the shared metric buffer (one D2H copy, two packed collectives),
    turns the lagged readout of the previous step into records (plus each monitor's
    derived values), emits them to the run's sinks on rank 0 (the values are
    cluster-wide, identical on every rank), and sets each monitor's cadence for the
    next step.

    ``background=True`` moves the decode, the derives and the records (2.3 ms of the
    H200 host's 2.9 ms per flush on the demo's large schema, 1,555 records) to a
    readout thread: ``step`` then copies the landed values out of the pinned ring and
    returns at once, and a step's records reach the sinks at a later ``step`` (or
    ``close``), in order. The thread needs the GIL for that work, and a host-bound
    forward holds it except across its read-backs: a thread that took it there would
    hand it back only after the interpreter's switch interval (5 ms), so the readout
    would land on the step's critical path all the same. It waits instead for the
    backward to start (a gradient hook on the last block's output), when training
    leaves the GIL to autograd's own thread for the whole backward, or for the next
    ``step`` when no backward comes (at most ``READOUT_WAIT_S``). Its time is billed as
    ``monitors/self/readout_host_ms``.

    The nonfinite monitor's alarm (syncless.monitors.alarm) is checked on every flushed
    copy as it lands, on this thread, and acted on from ``step`` (``on_nonfinite``).

    Inside CUDA graphs: each monitor's cadence is also written to its gate on the device
    (``MetricSet.set_gates``, only when it changes), which the replayed hooks' kernels
    read; ``step`` itself must run outside the captured region (docs/cuda_graphs.md).
    """

    def __init__(
        self,
        monitors: Sequence[Monitor],
        ctx: MonitorContext,
        run: Run | None,
        lagged: bool,
        emit: bool,
        background: bool = False,
        on_nonfinite: Action = "warn",
        on_spike: Action = "warn",
    ) -> None:
        self.monitors = list(monitors)
        self.ctx = ctx
        self.metrics = ctx.metrics
        self.run = run
        self.lagged = lagged
        self.emit = emit
        self.last_records: Sequence[StepRecord] = []
        self.readouts: list[Readout] = []  # the most recent flush's readouts
        # Exceptions caught in hooks, step, readouts and close (shared with the hooks);
        # ``attach(strict=True)`` makes it raise them.
        self.failures = ctx.failures
        self._failures_in_records = 0  # the count the latest records carry
        # Monitors attach() left out: nothing to watch in this model (name -> why).
        self.idle: dict[str, str] = {}
        self._last_step: int | None = None
        self._host_ms = 0.0
        # Host ns each monitor's hooks spent up to a flush, by flushed step (lagged like
        # the values they ride with), and in total since attach.
        self._hook_ns: dict[int, dict[str, int]] = {}
        self.hook_host_ns_total: dict[str, int] = dict.fromkeys(ctx.host_ns, 0)
        self._checked_names: set[str] = set()
        self._closed = False
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="syncless-monitors-readout")
            if background
            else None
        )
        self._inflight: deque[Future[tuple[Readout, StepRecords]]] = deque()
        # Set when a backward starts (or at the next step): the readout thread may run.
        self._go = threading.Event()
        self.readout_host_ns_total = 0  # the readout thread's, when ``background``
        self.budget = ctx.budget
        self.optimizer_steps = 0  # step calls that were optimizer steps (cadences count them)
        self.micro_steps = 0  # step(..., accumulate=True) calls
        self.paused = False
        # Monitors whose hooks record at every step (the nonfinite alarm): only their
        # readout follows the cadence.
        self.always_on = [m for m in self.monitors if getattr(m, "always_on", False)]
        self.nonfinite = next((m for m in self.monitors if isinstance(m, NonFiniteMonitor)), None)
        self._steps_since_flush = 0
        self._next_label = 0  # the label the device holds for the step in progress
        self._relabels: dict[float, int] = {}
        self._cuda = ctx.metrics.buffer is not None and ctx.metrics.buffer.is_cuda
        # Monitors active at each flushed step, for the silent-monitor check at readout.
        self._active_at: dict[int, list[str]] = {}
        # Metrics whose values are step labels the device wrote (by name: *_first_step).
        self._step_keys = [
            spec.key for spec in ctx.metrics.specs if spec.name.endswith("_first_step")
        ]
        self.silent = SilentMonitors(ctx.metrics, [m.name for m in self.monitors], emit)
        self._attribution = Attribution(ctx.metrics)
        ranks = (
            dist.get_world_size(ctx.metrics.group)
            if dist.is_available() and dist.is_initialized()
            else 1
        )
        self.alarm = (
            NonFiniteAlarm(self.metrics, on_nonfinite, self.label, emit, ranks, on_spike)
            if self.nonfinite is not None
            else None
        )
        self._set_cadence(0)

    @property
    def readout_errors(self) -> int:
        """Readouts that failed (decode, records), counted and not raised."""
        return self.failures.counts.get("readout", 0)

    @property
    def cadences(self) -> dict[str, int]:
        """Every how many steps each monitor runs now (the budget may change them)."""
        return {m.name: m.every for m in self.monitors}

    def pause(self) -> None:
        """Measure nothing until :meth:`resume` (evaluation, a phase not worth watching):
        every hook returns after one flag read and ``step`` flushes nothing. Call it
        after a step's ``step()``. The budget keeps what it learnt, so the cadences in
        force at ``resume`` are the ones a run that never paused would have. Inside a
        CUDA graph every gate is off: the replayed kernels return at once."""
        self.paused = True
        for m in self.monitors:
            m.active = False
        for m in self.always_on:
            m.watching = False  # type: ignore[attr-defined]
        self._write_gates()
        if self.budget is not None:
            self.budget.pause()

    def resume(self) -> None:
        """Measure again from the next step, at the cadences in force."""
        if self.paused:
            self.paused = False
            for m in self.always_on:
                m.watching = True  # type: ignore[attr-defined]
            self._set_cadence(self.optimizer_steps)

    def _set_cadence(self, step: int) -> None:
        budget = self.budget
        if budget is not None:
            # Hooks traced by torch.compile or replayed from a CUDA graph run no Python:
            # their cost comes from step times, over aligned cadences.
            budget.aligned = self.ctx.compiled or self.ctx.graphed
            budget.agree(step)
        for m in self.monitors:
            if budget is not None:
                m.every = budget.cadence[m.name]
            m.active = step % m.every == 0
        self._write_gates()
        if budget is not None:
            budget.arm(m.name for m in self.monitors if m.active)

    def _write_gates(self) -> None:
        """Each monitor's device gate as its hooks see it on the host: ``active``, and
        for an always-on monitor ``watching`` (a write only where one changed)."""
        self.metrics.set_gates(
            {m.name: getattr(m, "watching", True) if m in self.always_on else m.active
             for m in self.monitors}
        )  # fmt: skip

    def step(
        self,
        step: int,
        wait: bool | None = None,
        *,
        accumulate: bool = False,
        loss: torch.Tensor | None = None,
        grad_norm: torch.Tensor | None = None,
    ) -> StepRecords:
        """End of training step ``step``: flush, emit, and arm the next step.

        ``accumulate=True`` marks the end of a micro-batch of gradient accumulation (a
        framework hook that runs per micro-batch): nothing is flushed, the monitors stay
        armed, and the next micro-batches' values join the optimizer step's (sums,
        counts and maxima over all of them; the norms hook the optimizer step itself).
        Cadences count the calls without it, the optimizer steps; ``step`` labels the
        records.

        ``loss``/``grad_norm``: the step's loss and total gradient norm as device
        tensors (``clip_grad_norm_`` returns one), checked for NaN/Inf on the device at
        every step by the nonfinite monitor (``monitors/step/loss_nonfinite_count``,
        ``..._first_step``); nothing is read back here.

        Raises :class:`~syncless.monitors.NonFiniteError` under
        ``on_nonfinite="raise"`` when a readout landed since the last call found a NaN
        or Inf, after its records reached the run; :class:`~syncless.monitors.SpikeError`
        likewise under ``on_spike="raise"`` for a spike of the loss or the gradient
        norm. Raises ``UsageError`` inside a CUDA graph capture: call it after the
        replay, outside the captured region.
        """
        if capturing(self._cuda):
            raise UsageError(
                "handle.step() inside a CUDA graph capture: a replay would run its copy "
                "and collectives without the host that reads them. Capture the forward and "
                "backward only, and call handle.step() after graph.replay(), each step"
            )
        values = self._checked_values(loss, grad_norm)
        try:
            records = self._step(step, wait, accumulate, values)
        except Exception as e:  # syncless's own failure: the training step goes on
            self.failures.failed("step", e)
            records = StepRecords()
            self._arm_next(step)
        self._sound(records, self.metrics.flushes)
        return records

    def _step(
        self, step: int, wait: bool | None, accumulate: bool, values: dict[str, torch.Tensor]
    ) -> StepRecords:
        if values:
            assert self.nonfinite is not None
            self.nonfinite.check_values(values)
        if accumulate:
            self.micro_steps += 1
            return StepRecords()
        if self.paused:  # readouts of steps before the pause still land, and go out
            return self._collect(block=False)
        for bands in self.ctx.bands:  # this step's RMS of each layer against its band
            bands.update()
        self._last_step = step
        self.optimizer_steps += 1
        self._steps_since_flush += 1
        if step != self._next_label:
            self._relabels[float(self._next_label)] = step
            while len(self._relabels) > RELABELS_KEPT:
                del self._relabels[next(iter(self._relabels))]
        start = time.perf_counter()
        active = [m.name for m in self.monitors if m.active]
        any_active = bool(active)
        if any_active:
            self._take_hook_time(step)
            self._active_at[step] = active
            while len(self._active_at) > 16:  # a flush whose readout never came
                self._active_at.pop(next(iter(self._active_at)))
        hooks = self._hook_ns.get(step)  # the records' copy may be taken before the end
        wait = not self.lagged if wait is None else wait
        steps = self._steps_since_flush
        if self._executor is None or wait:
            records = self._collect(block=True)  # earlier steps' first: records stay ordered
            landed = self._flush(step, wait, copy=False) if any_active else []
            records.extend(self._read_here(landed))
        else:
            # Jobs submitted a step ago and still waiting: no backward came; go now.
            # Otherwise a signal from this step's backward is stale: the new job waits
            # for the next one. A replayed graph sends none (its hooks run no Python):
            # go at once, the host is free while the device runs the replay.
            if self._inflight or self.ctx.graphed:
                self._go.set()
            else:
                self._go.clear()
            for landed in self._flush(step, wait, copy=True) if any_active else []:
                own = self._own_inputs(landed.step)
                job = self._executor.submit(self._read_landed, landed, *own)
                self._inflight.append(job)
            records = self._collect(block=False)
        if not any_active:
            for m in self.always_on:
                m.end_step()  # type: ignore[attr-defined]
        if self.budget is not None:
            flush_ms = (time.perf_counter() - start) * 1e3
            self.budget.step_end(active, hooks, flush_ms if any_active else 0.0, steps)
        self._arm_next(step)
        self._host_ms = (time.perf_counter() - start) * 1e3
        return records

    def _arm_next(self, step: int) -> None:
        """The device's label and every monitor's cadence for the next step (also after
        a failed step: a monitor left active would record at every step from then on)."""
        if self.always_on or self.ctx.bands:  # they write step labels on the device
            self._next_label = step + 1
            self.metrics.set_step_label(self._next_label)
        self._set_cadence(self.optimizer_steps)

    def _checked_values(
        self, loss: torch.Tensor | None, grad_norm: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """``step``'s ``loss``/``grad_norm`` by name; a ``UsageError`` for what the
        nonfinite monitor cannot check without a sync."""
        if loss is None and grad_norm is None:
            return {}
        if self.nonfinite is None:
            raise UsageError(
                "handle.step(loss=, grad_norm=) is checked by the nonfinite monitor, which "
                "is not attached: add monitors.NonFiniteMonitor(), or drop the arguments"
            )
        values = {}
        for name, x in zip(CHECKED_VALUES, (loss, grad_norm), strict=True):
            if x is None:
                continue
            if not isinstance(x, torch.Tensor):
                raise UsageError(
                    f"handle.step({name}=...) needs the device tensor (e.g. loss.detach(), "
                    f"or what clip_grad_norm_ returns), got {type(x).__name__}: a Python "
                    "number was read back from the device already, which is the sync "
                    "syncless exists to avoid"
                )
            values[name] = x
        return values

    def _flush(self, step: int, wait: bool, copy: bool) -> list[Landed]:
        """The metric set's flush; every landed copy is checked for the alarm here, on
        the training thread, before any decode."""
        self._steps_since_flush = 0  # taken by this flush, even one that fails
        landed = self.metrics.flush_landed(step, wait=wait, copy=copy)
        for bands in self.ctx.bands:
            bands.after_flush()
        for batch in self.ctx.batches:
            error = batch.take_error()
            if error is not None:
                self.failures.failed("graph_capture", error)
        if self.alarm is not None:
            for x in landed:
                self.alarm.landed(x)
        return landed

    def label(self, device_label: float) -> int:
        """The step label ``step`` was given for a label the device recorded."""
        return self._relabels.get(device_label, int(device_label))

    def _relabel(self, readout: Readout) -> None:
        """Step-valued metrics of ``readout`` (``*_first_step``: labels the device wrote)
        as ``step`` labelled the steps."""
        if not self._relabels or readout.layout is None:
            return
        values = readout.flat_values
        assert values is not None
        for key in self._step_keys:
            start, end = readout.layout.slices[key]
            for i in range(start, end):
                values[i] = self._relabels.get(float(values[i]), values[i])

    def _sound(self, records: StepRecords, flushes: int | None) -> None:
        """Publish ``records``; then the alarm's due actions: the readouts they come
        from reach the run (and its files) first. The actions run outside the guard:
        ``NonFiniteError`` and a user callable's exceptions are the user's."""
        try:
            due = self.alarm.due(flushes) if self.alarm is not None else []
            if due and self._executor is not None:
                records.extend(self._collect(block=True))
            self._publish(records)
            if due and self.run is not None:
                self.run.flush()
        except Exception as e:
            self.failures.failed("step", e)
            return
        for event in due:
            self.alarm.act(event)  # type: ignore[union-attr]

    def backward_started(self, grad: torch.Tensor) -> None:
        """Gradient hook (autograd's thread): the readout thread may run now."""
        self._go.set()

    def _own_inputs(
        self, step: int
    ) -> tuple[dict[str, int] | None, float, dict[str, float] | None]:
        """What a step's self-cost records need from the training thread: its hooks'
        ledger, the host time of the last ``step`` call and the budget's state (taken
        before that thread moves on)."""
        budget = None if self.budget is None else self.budget.records(AREA)
        return self._hook_ns.pop(step, None), self._host_ms, budget

    def _read_landed(
        self,
        landed: Landed,
        hooks: dict[str, int] | None,
        host_ms: float,
        budget: dict[str, float] | None,
    ) -> tuple[Readout, StepRecords]:
        """The readout thread's job: decode, derive, records."""
        # Bounded: a handle never closed must not keep the interpreter from exiting
        # (it joins this thread), and a step longer than this has time to spare.
        self._go.wait(timeout=READOUT_WAIT_S)
        self._go.clear()
        start = time.perf_counter_ns()
        readout = self.metrics.decode(landed)
        records = self._readout_records(readout, hooks, host_ms, budget, start)
        self.readout_host_ns_total += time.perf_counter_ns() - start
        return readout, records

    def _collect(self, block: bool) -> StepRecords:
        """Records of the readout thread's finished jobs, oldest first (all of them when
        ``block``). A failed job is counted and reported, not raised (unless strict)."""
        records = StepRecords()
        while self._inflight and (block or self._inflight[0].done()):
            if block:
                self._go.set()  # each waiting job takes one signal
            try:
                readout, done = self._inflight.popleft().result()
            except Exception as e:
                self.failures.failed("readout", e)
                continue
            self.readouts = [readout]
            records.extend(done)
        return records

    def _take_hook_time(self, step: int) -> None:
        ledger = self.ctx.host_ns
        self._hook_ns[step] = dict(ledger)
        while len(self._hook_ns) > 4:  # a flush whose readout never came (error paths)
            self._hook_ns.pop(next(iter(self._hook_ns)))
        for name, ns in ledger.items():
            self.hook_host_ns_total[name] = self.hook_host_ns_total.get(name, 0) + ns
            ledger[name] = 0

    def _read_here(self, landed: Sequence[Landed]) -> StepRecords:
        """Decode and record ``landed`` on this thread (no readout thread, or ``wait``);
        a readout that fails is counted and skipped."""
        records = StepRecords()
        readouts = []
        for x in landed:
            try:
                r = self.metrics.decode(x)
                records.extend(self._readout_records(r, *self._own_inputs(r.step)))
            except Exception as e:
                self.failures.failed("readout", e)
                continue
            readouts.append(r)
        if readouts:
            self.readouts = readouts
        return records

    def _readout_records(
        self,
        r: Readout,
        hooks: dict[str, int] | None,
        host_ms: float,
        budget: dict[str, float] | None,
        readout_start_ns: int | None = None,
    ) -> StepRecords:
        records = StepRecords()
        rank = self.run.ranks.rank if self.run else 0
        name = self.run.name if self.run else ""
        now = time.time()
        self._relabel(r)
        records.extend(r.records(name, rank, now))
        active = self._active_at.pop(r.step, None)
        if active is not None:
            self.silent.check(r, active)
        moved = self._attribution.in_readout(r) if self._attribution else None
        if moved is not None:
            records.add(
                name, r.step, rank, [f"{AREA}/step/moved_first_step", f"{AREA}/step/moved_first_layer"],
                [moved.step, float(moved.layer)], now,
            )  # fmt: skip
        for m in self.monitors:
            derived = self._derive(m, r)
            unchecked = derived.keys() - self._checked_names
            if unchecked:  # a regex per name once, not per name per flush
                self._checked_names.update(check_metric_name(k) for k in unchecked)
            records.add(name, r.step, rank, derived.keys(), derived.values(), now)
        # The measurement bills itself: host time of the previous step() call, of every
        # hook up to this readout's flush (this rank's; rank 0 emits) and, with a
        # readout thread, of that thread's work on this readout so far.
        own = self.failures.records(AREA)
        self._failures_in_records = int(own[f"{AREA}/self/errors_count"])
        own.update(self.silent.records(AREA))
        own[f"{AREA}/self/flush_host_ms"] = host_ms
        if hooks:
            for monitor, ns in hooks.items():
                own[f"{AREA}/self/{monitor}_hook_host_ms"] = ns / 1e6
            own[f"{AREA}/self/hook_host_ms"] = sum(hooks.values()) / 1e6
        if budget:
            own.update(budget)
        for monitor, n in list(self.ctx.recompute_skips.items()):
            if n:  # since attach: hook calls in activation-checkpointing recomputes
                own[f"{AREA}/self/{monitor}_recompute_skipped_count"] = float(n)
        if readout_start_ns is not None:
            own[f"{AREA}/self/readout_host_ms"] = (time.perf_counter_ns() - readout_start_ns) / 1e6
        records.add(name, r.step, rank, own.keys(), own.values(), now)
        return records

    def _derive(self, monitor: Monitor, readout: Readout) -> dict[str, float]:
        """A monitor's derived values; a failure is counted and reported, not raised
        into the training step (unless ``strict``)."""
        try:
            return monitor.derive(readout)
        except Exception as e:
            self.failures.failed(f"{monitor.name}_derive", e)
            return {}

    def _publish(self, records: StepRecords) -> None:
        self.last_records = records
        if self.run is None:
            return
        if self.emit:
            if records:
                self.run.emit(records)
        elif self.failures.total != self._failures_in_records:
            # The cluster-wide values go out from rank 0 only; a rank's own failures go
            # to its own shard.
            self._emit_failures()

    def _emit_failures(self) -> None:
        """This rank's failure counts, at the last step (records of their own)."""
        if self.run is None or self._last_step is None:
            return
        own = self.failures.records(AREA)
        self._failures_in_records = int(own[f"{AREA}/self/errors_count"])
        records = StepRecords()
        records.add(
            self.run.name, self._last_step, self.run.ranks.rank, own.keys(), own.values(),
            time.time(),
        )  # fmt: skip
        self.run.emit(records)

    def close(self) -> StepRecords:
        """Read the last pending flush, emit it, remove every hook. Failures on the way
        are counted (and the count recorded at the last step); the hooks are removed
        whatever happens."""
        if self._closed:
            return StepRecords()
        self._closed = True
        records, due = StepRecords(), []
        try:
            records, due = self._final_readouts()
        except Exception as e:
            self.failures.failed("close", e)
        finally:
            for h in self.ctx.handles:
                h.remove()
            self.ctx.handles.clear()
        for m in self.monitors:
            try:
                m.close()
            except Exception as e:
                self.failures.failed("close", e)
        if self.ctx.graphed:
            # A graph that captured the hooks may replay after this: its kernels read
            # these tables and gates and write this buffer. Gates off, memory kept.
            self.metrics.set_enabled(False)
            _KEPT_FOR_GRAPHS.append((self.ctx, self.monitors))
        try:
            if self.budget is not None and self.emit and self.monitors:
                print(self.budget.summary(), file=sys.stderr)
            if self.failures.total != self._failures_in_records:
                self._emit_failures()  # counted in close, or since the last records
        except Exception as e:
            self.failures.failed("close", e)
        for event in due:  # every rank closes at the same point: act on what is left
            self.alarm.act(event)  # type: ignore[union-attr]
        return records

    def _final_readouts(self) -> tuple[StepRecords, list]:
        """Every readout still in flight or pending, published; the alarm's due events."""
        for batch in self.ctx.batches:  # reads of a step that was never flushed
            batch.finish()
        records = self._collect(block=True)
        if self._executor is not None:
            self._go.set()
            self._executor.shutdown(wait=True)
        if self._steps_since_flush and self.always_on and self._last_step is not None:
            # The alarm counted the steps since its last readout: read them now, or a
            # NaN there would be lost (a flush also checks each landed copy).
            drained = self._flush(self._last_step, wait=True, copy=False)
        else:
            drained = self.metrics.drain_landed()
            if self.alarm is not None:
                for x in drained:
                    self.alarm.landed(x)
        records.extend(self._read_here(drained))
        due = self.alarm.due(None) if self.alarm is not None else []
        self._publish(records)
        if due and self.run is not None:
            self.run.flush()
        return records, due
