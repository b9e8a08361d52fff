"""The capture engine: tensors out of training into a run directory, without stalls.

A capture point (a forward hook, a training loop) calls ``engine.capture(tag,
tensor)``. That reserves space for the tensor in a preallocated device ring (host
bookkeeping from its shape and dtype: no sync) and copies it there device to device on
the current stream; an event says when the copy has landed (recorded by the drain for
batched captures, :mod:`syncless.capture.ring.landing`). A drain worker copies ready
records, whole and oldest first, into a preallocated pinned staging ring on its own
stream and hands them to the sink (safetensors shards plus a Parquet index in the run
directory). When the framework declares recurring windows
(:meth:`CaptureEngine.define_pattern`) and publishes boundaries from its stream
(:meth:`CaptureEngine.advance_boundary`), the grant controller decides how many bytes
each window carries and the drain copies only then.

Nothing is lost silently: a record is stored, or dropped and counted with a reason
(:class:`~syncless.capture.stats.DropReason`). See docs/capture.md.

The engine owns its parts and is their only link: the device ring and its copier
(:mod:`~syncless.capture.ring.copier`), the record queue
(:mod:`~syncless.capture.ring.records`), the boundary clock
(:mod:`~syncless.capture.boundary`), the grant controller, the counters
(:mod:`~syncless.capture.stats`), the writer (:mod:`~syncless.capture.writer`) and the
drain (:mod:`~syncless.capture.drain`). docs/capture.md opens with who owns whom and
which thread runs what.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.compiler import is_compiling

from syncless.capture.arguments import check_capture, check_defer, check_meta
from syncless.capture.boundary import BoundaryClock
from syncless.capture.config import (
    EngineConfig,
    OnFull,
    check_on_full,
    resolve_device,
    resolve_sink,
)
from syncless.capture.controller import ControllerConfig, GrantController
from syncless.capture.drain import DrainWorker
from syncless.capture.drain.window_reports import WindowReport
from syncless.capture.engine_setup import check_sizes, event_factory, resolve_controller
from syncless.capture.ring.copier import RingCopier
from syncless.capture.ring.records import VOID, WRITTEN, Record, RecordQueue
from syncless.capture.shortfall import Shortfall
from syncless.capture.sinks.shards import CaptureSink
from syncless.capture.stats import GAUGES, SELF_COUNTERS, CaptureStats, DropReason, ThreadClock
from syncless.capture.windows import WindowPattern
from syncless.capture.writer import SinkWriter, writer_count
from syncless.guard import allow_sync
from syncless.hot_path import hot_path
from syncless.run.dist import rank_info

if TYPE_CHECKING:
    from syncless.run import Run

__all__ = ["CaptureEngine", "EngineConfig", "OnFull"]

# Reasons a waiting capture can outlast; the others are final.
_WAITABLE = (DropReason.RING_FULL, DropReason.RECORDS_FULL)


class CaptureEngine:
    """Captures tensors from training into a sink without a host sync on the hot path.

    Args:
        ring_bytes: bytes of the device ring that captures copy into.
        staging_bytes: bytes of the pinned host staging ring the drain copies into; the
            most one transfer (and one window grant) can carry. At most ``ring_bytes``.
        sink: a :class:`~syncless.capture.sinks.shards.CaptureSink`, or a run directory (then
            ``SafetensorsSink(run_dir, rank)``). Default: the ``run``'s directory.
        device: where the tensors to capture live; default the current CUDA device if
            there is one, else the CPU. Every captured tensor must be on it.
        run: a :class:`~syncless.run.Run`: rank, default sink, and where
            :meth:`report` sends ``capture/step/*`` step records.
        on_full: what a capture does when the ring is full, unless it says otherwise:
            ``"drop"`` (count it, go on), ``"block"`` (wait until the drain frees room;
            can stall the step: the caller's explicit choice), ``"flush"`` (have the drain
            copy out everything ready now, outside any window, and wait for it).
        config: tuning (:class:`EngineConfig`).
        controller: the grant controller (default: one over ``staging_bytes``).
        controller_config: its configuration, when the engine makes it.
        background: run the drain and the writer on threads of their own. False: they
            run only inside :meth:`poll`, :meth:`flush`, :meth:`close` and waiting
            captures, on the caller's thread (deterministic; for tests and for loops
            that want to drive the drain themselves).
        strict: raise sink and drain errors on the training thread (at the next
            capture, flush, report or close) instead of only counting them.
        clock: host clock for boundary stamps and copy timings on CPU.

    Raises:
        ValueError: a bad size, policy, device or sink, saying what was expected.
    """

    def __init__(
        self,
        ring_bytes: int,
        staging_bytes: int,
        sink: CaptureSink | str | os.PathLike[str] | None = None,
        *,
        device: torch.device | str | None = None,
        run: Run | None = None,
        on_full: OnFull = "drop",
        config: EngineConfig | None = None,
        controller: GrantController | None = None,
        controller_config: ControllerConfig | None = None,
        background: bool = True,
        strict: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        cfg, ring_bytes, staging_bytes = check_sizes(ring_bytes, staging_bytes, config)
        self._on_full = check_on_full(on_full)
        self._device = resolve_device(device)
        self._cuda = self._device.type == "cuda"
        self._rank = run.ranks.rank if run is not None else rank_info().rank
        self._run = run
        self._sink = resolve_sink(sink, run, self._rank)
        self._strict = strict
        self._background = background
        self._config = cfg
        self._staging_bytes = staging_bytes
        self._ctl = resolve_controller(controller, controller_config, staging_bytes)
        self._ctl_lock = threading.Lock()

        # Everything the hot path touches is allocated here, once.
        self._ring = torch.empty(ring_bytes, dtype=torch.uint8, device=self._device)
        self._copier = RingCopier(self._ring)
        staging = torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=self._cuda)
        self._queue = RecordQueue(
            ring_bytes, cfg.align, cfg.max_records, event_factory(self._device)
        )
        self._boundary = BoundaryClock(self._device, cfg.boundary_pool, clock)
        self._stats = CaptureStats()
        writers = writer_count(self._sink, cfg.writers, background)
        # Staging holds a shard per writer plus the one filling: all writers busy.
        shard_bytes = cfg.shard_bytes or staging_bytes // (writers + 1)
        # The writer gives staging back to the drain, which is built next with the
        # writer in hand: the lambda looks the drain up when a shard is written.
        self._writer = SinkWriter(
            self._sink,
            lambda: self._drain.release_staging(),
            self._stats,
            shard_bytes,
            cfg.shard_interval_s,
            background,
            workers=writers,
        )
        self._drain = DrainWorker(
            queue=self._queue,
            ring=self._ring,
            staging=staging,
            boundary=self._boundary,
            controller=self._ctl,
            controller_lock=self._ctl_lock,
            writer=self._writer,
            stats=self._stats,
            rank=self._rank,
            late_issue_s=cfg.late_issue_s,
            poll_interval_s=cfg.poll_interval_s,
            gather_bytes=cfg.gather_bytes or max(cfg.align, ring_bytes // 4),
            gather_s=cfg.gather_interval_s,
            batch_bytes=shard_bytes,
            planned=self._cuda if cfg.planned_windows is None else cfg.planned_windows,
            copy_held=self._copier.copy_held,
        )
        self._defer_below = cfg.defer_copy_below
        self._shortfall = Shortfall(type(self._sink).__name__, writers, ring_bytes, staging_bytes)
        self._closed = False
        self._last_step = 0
        self._thread_clock = ThreadClock()
        if background:
            self._drain.start()

    # -- properties ---------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def ring_bytes(self) -> int:
        return self._ring.numel()

    @property
    def staging_bytes(self) -> int:
        return self._staging_bytes

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def sink(self) -> CaptureSink:
        return self._sink

    @property
    def controller(self) -> GrantController:
        return self._ctl

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def shortfall(self) -> str | None:
        """Why the first record that found no room was dropped (also printed on
        stderr once): which stage is short, at what rates. None before any such drop."""
        return self._shortfall.message

    @property
    def drain_error(self) -> BaseException | None:
        """What killed the drain worker, if it died (captures then drop: drain_error)."""
        return self._drain.error

    # -- the hot path -------------------------------------------------------------------

    @hot_path
    def capture(
        self,
        tag: str,
        tensor: torch.Tensor,
        *,
        step: int | None = None,
        meta: Mapping[str, Any] | None = None,
        on_full: OnFull | None = None,
        defer: bool | None = None,
    ) -> bool:
        """Capture ``tensor``: copy it into the device ring, to be drained to the sink.

        Safe in a hook: no host sync, no allocation beyond a view of the ring. The copy
        runs on the current stream; the tensor may be freed or overwritten afterwards,
        unless the copy is deferred (``defer``).

        Args:
            tag: what this is (e.g. ``"layer_03/hidden"``); the index's ``tag``.
            tensor: any strided tensor on the engine's device, any dtype and shape
                (0-d, empty and non-contiguous included); autograd is not involved.
            step: the training step, for the index (optional).
            meta: JSON-serialisable details for the index, serialised now (a snapshot).
            on_full: this capture's policy when the ring is full (default: the engine's).
            defer: leave the copy to the drain, which enqueues it on the same stream
                later; the training thread then makes no driver call, but the tensor
                must not change until then (a change its version counter shows drops
                the record as ``changed``; docs/capture.md, "Deferred copies"). Default:
                tensors under ``EngineConfig.defer_copy_below`` bytes. Only while the
                drain batches (not in planned windows), for contiguous tensors.

        Returns:
            True if the tensor is in the ring (it will be stored unless the sink fails),
            False if it was dropped (counted with its reason; see :meth:`dropped`).

        Raises:
            ValueError: not a strided tensor on the engine's device, a bad tag, step,
                meta or policy. RuntimeError: inside CUDA graph capture; in strict mode,
                a sink or drain error from earlier.
        """
        if is_compiling():  # dynamo traces this hook: one opaque call instead
            return capture_outside_graph(self, tag, tensor, step, meta, on_full, defer)
        # One flat function on purpose: each Python call costs the host 60-100 ns, and
        # the engine's Python was 3.5-4.1 us of the H200 host per capture (capture_host).
        t0 = time.perf_counter_ns()
        counts = self._stats.thread_counts()
        if self._strict:
            self._raise_errors()
        if on_full is not None:
            on_full = check_on_full(on_full)  # checked here, used only without room
        stream = self._copier.stream()
        check_capture(tag, tensor, step, self._device, stream)
        nbytes = tensor.nbytes
        defer = nbytes < self._defer_below if defer is None else check_defer(tag, defer)
        meta_json = None if meta is None else check_meta(meta)
        if self._shortfall.started is None:  # the first capture: a call only then
            self._shortfall.start()
        counts.offered_count += 1
        counts.offered_bytes += nbytes
        rec, reason = self._queue.try_reserve(tag, step, tensor, nbytes, meta_json)
        if rec is None:
            rec = self._no_room(tag, step, tensor, nbytes, meta_json, on_full, reason)
        if rec is not None:
            try:
                self._copier.copy(rec, tensor, stream, self._drain.defer_landing, defer)
            except BaseException:
                rec.state = VOID  # its ring space is released in order, its bytes ignored
                self._stats.drop(DropReason.COPY_ERROR, nbytes)
                raise
            rec.state = WRITTEN
            self._drain.captured(rec.source is not None)
            counts.captured_count += 1
            counts.captured_bytes += nbytes
        counts.host_ns += time.perf_counter_ns() - t0
        return rec is not None

    @hot_path
    def _no_room(
        self,
        tag: str,
        step: int | None,
        tensor: torch.Tensor,
        nbytes: int,
        meta: str | None,
        on_full: OnFull | None,
        reason: DropReason | None,
    ) -> Record | None:
        """No record for this capture now: wait for room if the policy says so, else
        count the drop (and explain the first for lack of room)."""
        policy = self._on_full if on_full is None else on_full
        rec = None
        if policy != "drop" and reason in _WAITABLE:
            rec, reason = self._wait_for_room(tag, step, tensor, nbytes, meta, policy)
        if rec is None:
            assert reason is not None
            self._stats.drop(reason, nbytes)
            if reason in _WAITABLE and self._shortfall.message is None:
                recent = self._writer.recent_rate()
                self._shortfall.drop(self.counters(), reason.value, tag, step, recent)
        return rec

    @hot_path
    def _wait_for_room(
        self,
        tag: str,
        step: int | None,
        tensor: torch.Tensor,
        nbytes: int,
        meta: str | None,
        policy: OnFull,
    ) -> tuple[Record | None, DropReason | None]:
        """The ring is full and the caller chose to wait (block) or to flush."""
        t0 = time.perf_counter_ns()
        rec, reason = None, DropReason.RING_FULL
        with allow_sync(f"capture(on_full={policy!r}): the caller chose to wait for the drain"):
            while rec is None and reason in _WAITABLE:
                req = self._drain.request(
                    "block" if policy == "block" else "capacity", self._queue.ring.span(nbytes)
                )
                self._drain.wait(req)
                rec, reason = self._queue.try_reserve(tag, step, tensor, nbytes, meta)
        self._stats.add2("blocked_count", 1, "blocked_ms", (time.perf_counter_ns() - t0) / 1e6)
        return rec, reason

    @hot_path
    def advance_boundary(self, stream: torch.cuda.Stream | None = None) -> None:
        """Publish the next boundary from ``stream`` (default: the current stream).

        No host sync; capturable in a CUDA graph (see
        :mod:`syncless.capture.boundary` for what is measured under replay).
        """
        t0 = time.perf_counter_ns()
        boundary, drain = self._boundary, self._drain
        boundary.advance(stream)
        if drain.plan is not None:  # a window copy waits for this boundary?
            drain.launch_plan(boundary.version, boundary.published - 1)
        elif boundary.published == drain.wake_at:  # the drain waits for this boundary
            drain.notify()
        self._stats.add2(
            "boundary_count", 1, "boundary_host_ms", (time.perf_counter_ns() - t0) / 1e6
        )

    # -- windows (cold: declared once, or around a phase such as evaluation) ------------

    def define_pattern(
        self, pattern: WindowPattern, stream: torch.cuda.Stream | None = None
    ) -> int:
        """Declare recurring windows; returns the pattern's version.

        Boundaries count from 0 again under a new pattern, ordered on ``stream`` (default:
        the current stream) with the boundaries published there. Redefining the current
        pattern keeps its version, its count and what the controller learnt.
        """
        self._check_open("define_pattern")
        with self._ctl_lock:
            before = self._ctl.version
            version = self._ctl.define_pattern(pattern)
        if version != before:
            self._boundary.set_version(version, stream)
        self._drain.notify()  # an idle batching drain sleeps until told
        return version

    def suspend(self) -> None:
        """Enter a phase without windows (evaluation): the drain batches, nothing counts
        against the windows, and nothing in it can trigger the fallback."""
        self._check_open("suspend")
        with self._ctl_lock:
            self._ctl.suspend()
        self._drain.notify()

    def resume(self) -> None:
        """Leave the phase entered by :meth:`suspend`."""
        self._check_open("resume")
        with self._ctl_lock:
            self._ctl.resume()
        self._drain.notify()

    # -- the drain, flushed and closed (host waits: the end of a phase or of the run) ----

    def poll(self) -> bool:
        """Run one drain iteration on this thread (``background=False`` only)."""
        if self._background:
            raise RuntimeError("poll() is for background=False engines: the drain runs itself")
        if self._closed:
            return False
        return self._drain.step()

    def flush(self) -> None:
        """Wait until every record captured so far is stored (or dropped and counted).

        A host wait, outside any window: for the end of a phase, not for every step.
        """
        if self._strict:
            self._raise_errors()
        if self._closed or self._drain.error is not None:
            return
        self._drain.wait(self._drain.request("lifecycle"))
        if self._strict:
            self._raise_errors()

    def close(self, step: int | None = None) -> None:
        """Drain and store everything, stop the threads, close the sink. Idempotent.

        A closed engine refuses captures (each counted as dropped, reason ``closed``)
        and cannot be reopened. With a ``run``, a last :meth:`report` goes out at
        ``step`` (default: the last step reported).
        """
        if self._closed:
            return
        self._closed = True
        self._queue.close()
        if self._drain.error is None:
            self._drain.wait(self._drain.request("lifecycle"))
        self._drain.stop()
        if self._drain.error is not None:
            # The drain died: what is left in the ring will never be stored.
            count, nbytes = self._queue.abandon()
            if count:
                self._stats.drop(DropReason.DRAIN_ERROR, nbytes, count)
        self._writer.close()
        if self._run is not None:
            self.report(self._last_step if step is None else step)
        if self._strict:
            self._raise_errors()

    def __enter__(self) -> CaptureEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- numbers (cold: once per step at most) --------------------------------------------

    def report(self, step: int) -> dict[str, float]:
        """This step's numbers (counters since the last report, gauges now), sent to the
        ``run`` as ``capture/step/*`` and ``capture/self/*`` step records.

        ``capture/self/*`` is the engine's own cost: host time in ``capture()`` and
        ``advance_boundary()``, drain loops, and the CPU time of the drain and writer
        threads.
        """
        if self._strict:
            self._raise_errors()
        self._last_step = step
        self._stats.add2(
            "drain_cpu_ms",
            self._thread_clock.advance(self._drain.thread),
            "writer_cpu_ms",
            sum(self._thread_clock.advance(t) for t in self._writer.threads),
        )
        values: dict[str, float] = {}
        for name, value in self._stats.deltas().items():
            values[f"capture/{'self' if name in SELF_COUNTERS else 'step'}/{name}"] = value
        values["capture/self/drain_look_max_ms"] = self._stats.take_look_max()
        gauges = self._gauges()
        values.update({f"capture/step/{name}": gauges[name] for name in GAUGES})
        if self._run is not None:
            self._run.log(step, values)
        return values

    # Marked because _no_room reads them to explain the first drop for lack of room.
    @hot_path
    def counters(self) -> dict[str, float]:
        """Every counter, cumulative since the engine started, and the gauges now."""
        return {**self._stats.snapshot(), **self._gauges()}

    def dropped(self) -> dict[str, int]:
        """Dropped records by reason (every reason listed, zeros included)."""
        return self._stats.dropped()

    def window_reports(self) -> list[WindowReport]:
        """What the engine reported for each recent window transfer (oldest first)."""
        return list(self._drain.reports)

    # -- internals ------------------------------------------------------------------------

    def _gauges(self) -> dict[str, float]:
        with self._ctl_lock:
            fallback = self._ctl.fallback
        return {
            "pending_count": self._stats.balance(),
            "ring_used_bytes": self._queue.used_bytes(),
            "staging_used_bytes": self._drain.staging_used(),
            "fallback": int(fallback),
        }

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}(): the capture engine is closed (it cannot be reopened)")

    # capture() raises through it in strict mode, so the linter checks it with the hot path.
    def _raise_errors(self) -> None:
        for owner in (self._writer, self._drain):
            err = owner.take_error()  # raised once, like syncless.run's Parquet writer
            if err is not None:
                raise RuntimeError(f"capture {type(owner).__name__} failed: {err!r}") from err


# In a hook of a torch.compile'd module, dynamo traced into capture() and broke its
# graph at the host calls inside: over two steps of three captures (aot_eager, torch
# 2.13), 6 graphs and 15 breaks in capture()'s own code (perf_counter_ns, a lock,
# is_conj, is_inference, ...). Through this, 5 graphs and a break at each call site.
# capture() calls it when it finds itself traced; eager callers never get here.
@torch.compiler.disable
def capture_outside_graph(
    engine: CaptureEngine,
    tag: str,
    tensor: torch.Tensor,
    step: int | None,
    meta: Mapping[str, Any] | None,
    on_full: OnFull | None,
    defer: bool | None,
) -> bool:
    """``engine.capture(...)``, run eagerly: one opaque call for dynamo."""
    return engine.capture(tag, tensor, step=step, meta=meta, on_full=on_full, defer=defer)
