"""The monitor lifecycle: declare, allocate, attach hooks, derive at flush, close.

A monitor never allocates or reads back on its own: it declares its metrics into the
shared ``MetricSet`` (one packed buffer for every monitor), records into the slots from
its hooks (device ops only), and derives whatever needs the cluster-wide values (ratios,
entropies over summed counts) on the host from the flushed ``Readout``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from syncless.graphs import capturing
from syncless.metrics import MetricSet, Readout
from syncless.monitors.adapters import LayerSite, ModelMap
from syncless.monitors.bands import LayerBands
from syncless.monitors.budget import Budget
from syncless.monitors.failures import Failures
from syncless.monitors.layer_batch import LayerBatch
from syncless.recompute import recomputing

AREA = "monitors"


def compiled_and_run(roots: list[nn.Module]) -> bool:
    """Whether ``roots`` hold a torch.compile'd module while dynamo has compiled graphs
    already and does not guard on module hooks (its default): hooks attached now are
    then invisible to the graphs cached for these modules. A tiny 2-layer Mixtral
    attached after its first compiled step recorded 14 of 56 layer metrics compiled per
    layer and none compiled whole (issue #20)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or not dynamo.config.skip_nnmodule_hook_guards:
        return False
    if not dynamo.utils.counters["stats"]["unique_graphs"]:
        return False
    return any(
        getattr(m, "_compiled_call_impl", None) is not None or hasattr(m, "_orig_mod")
        for root in roots
        for m in root.modules()
    )


def check_every(every: int) -> int:
    """A monitor's cadence: a positive number of steps."""
    if every < 1:
        raise ValueError(f"every must be >= 1 (record every N steps), got {every}")
    return every


@dataclass
class MonitorContext:
    """What a monitor gets at ``prepare``/``attach``: the model's map, the shared
    metric set, and the list its hook handles go into (removed at close)."""

    model: ModelMap
    metrics: MetricSet
    # The modules attach() was given (the model, or its pipeline chunks), wrappers and all.
    roots: list[nn.Module] = field(default_factory=list)
    handles: list[RemovableHandle] = field(default_factory=list)
    # Host nanoseconds spent in each monitor's hooks since the handle last read them.
    host_ns: dict[str, int] = field(default_factory=dict)
    # Grouped launches (``launch="grouped"``) the handle completes before each flush.
    batches: list[LayerBatch] = field(default_factory=list)
    # Per-layer bands the handle updates at every step, after the backward
    # (syncless.monitors.bands).
    bands: list[LayerBands] = field(default_factory=list)
    # The overhead budget (``attach(..., budget=)``): which monitors' hooks are timed on
    # the device this step, and where their timing events go.
    budget: Budget | None = None
    # Hook calls skipped because they fired in an activation-checkpointing recompute.
    recompute_skips: dict[str, int] = field(default_factory=dict)
    # A hook was traced by torch.compile (the budget then aligns cadences).
    compiled: bool = False
    # A hook ran inside a CUDA graph capture: its replays run no Python, so the
    # cadences work through the gates, and the budget measures from step times.
    graphed: bool = False
    # Exceptions caught in hooks (and, through the handle, in step, readout and close).
    failures: Failures = field(default_factory=Failures)

    def timed(
        self, monitor: str, hook: Callable[..., Any], backward: bool = False
    ) -> Callable[..., Any]:
        """``hook`` billing its host time to ``monitor`` (two clock reads, ~0.1 us).

        The stack reports its own cost (``monitors/self/<name>_hook_host_ms``): on a
        host-bound step that is what it adds, read without step-time noise. On the
        steps the budget times ``monitor`` (``Budget.timing``), a pair of timing events
        around the call measures its device work too. An exception from ``hook`` is
        counted (``monitors/self/<name>_hook_errors_count``), not raised into the
        model's forward (syncless.monitors.failures). ``backward``: a gradient hook, which
        runs inside the backward by nature (a forward hook there is a recompute's).
        """
        ledger = self.host_ns
        ledger.setdefault(monitor, 0)
        skips = self.recompute_skips
        skips.setdefault(monitor, 0)
        clock = time.perf_counter_ns
        ctx = self
        place = f"{monitor}_hook"
        cuda = self.metrics.buffer is not None and self.metrics.buffer.is_cuda

        def billed(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                # Traced into the graph: a clock read or a timing event would break it
                # (issue #20: 6 breaks on a 2-layer Llama); compiled code is not billed.
                ctx.compiled = True  # replayed by dynamo after the graph: one store
                return hook(*args, **kwargs)
            if not backward and recomputing():
                skips[monitor] += 1
                return None
            if capturing(cuda):
                ctx.graphed = True
            start = clock()
            budget = ctx.budget
            try:
                if budget is None or monitor not in budget.timing:
                    return hook(*args, **kwargs)
                span = budget.begin()
                out = hook(*args, **kwargs)
                budget.end(monitor, span)  # not reached on failure: a span left open
                return out
            except Exception as e:
                ctx.failures.failed(place, e)
                return None
            finally:
                ledger[monitor] += clock() - start

        billed.guarded = True  # type: ignore[attr-defined]  # Failures.guard_hook: not again
        return billed

    def attach_output(self, monitor: Any, site: LayerSite, record: Callable[..., Any]) -> None:
        """Hook ``record``, billed to ``monitor``, on ``site``'s block output; the monitor
        keeps the callback and the handles in its ``output_records``/``output_handles``
        (``output_read`` may replace the handles with one hook shared with a partner).

        A site whose output is a copy another rank measures (``output_replica``) is not
        hooked: its counts would be summed once per copy."""
        if getattr(site, "output_replica", False):  # sites of adapters written before it
            return
        handles = site.attach_output(self.timed(monitor.name, record))
        monitor.output_records[site.index] = record
        monitor.output_handles[site.index] = handles
        self.handles += handles


class Monitor(Protocol):
    """``active`` is the host-side cadence switch the handle sets before each step
    (``step % every == 0``): a hook returns at once when it is False, so an off-step
    costs one Python attribute read per hook and no kernel. Inside a CUDA graph capture
    (``syncless.graphs.capturing()``) a hook records whatever ``active`` says: every
    replay re-runs what was captured, and the device flag of the monitor's metrics (the
    gate named after it, which the handle sets from ``active``) decides at each replay.
    Metrics a monitor declares in ``prepare`` are gated by its name."""

    name: str
    every: int  # record every N steps (1 = every step)
    active: bool

    def prepare(self, ctx: MonitorContext) -> None:
        """Declare every metric this monitor may record (before allocate)."""

    def attach(self, ctx: MonitorContext) -> None:
        """Install hooks (after allocate); append their handles to ``ctx.handles``."""

    def derive(self, readout: Readout) -> dict[str, float]:
        """Host-side values derived from the flushed cluster-wide readout: metric
        name -> value (names follow ``area/scope/name_unit``)."""

    def close(self) -> None:
        """Release anything held beyond hook handles (e.g. optimizer hooks)."""
