"""One read of each layer output for the activations and nonfinite monitors together.

Both monitors read the same tensor, every block's output: apart, that is two hooks,
two grouped kernels and two folds per forward, and two passes over every activation.
When both are attached with grouped launches over the same layers, one hook per block
holds the output for both (each hook call is 11-18 us of the H200's host, so the
second one was 0.4 ms per step on the demo's 24 layers), one kernel computes the
per-channel maxima and the NaN/Inf counts in one pass
(``kernels.output_stats_partials_grouped``) and one fold updates both monitors' slots
and the alert (every layer's count column feeds it by an atomic max in the fold, as
in the nonfinite monitor's own batch).

The activations monitor keeps its cadence, the nonfinite one records at every step
(its alarm never sleeps): a step where the activations monitor is inactive uses the
nonfinite monitor's own batch, through its own callback. The per-layer fallback (see
``layer_batch``) runs both monitors' own per-layer launches. The shared hook bills its
host time to the active monitors (half each when both are).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from syncless import kernels
from syncless.graphs import capturing
from syncless.metrics.slot_group import SlotGroup
from syncless.monitors.activations import ActivationsMonitor
from syncless.monitors.base import Monitor, MonitorContext
from syncless.monitors.layer_batch import LayerBatch
from syncless.monitors.nonfinite import NonFiniteMonitor
from syncless.recompute import recomputing


def fuse_output_reads(ctx: MonitorContext, monitors: Sequence[Monitor]) -> LayerBatch | None:
    """Share one grouped read between an attached activations and nonfinite monitor;
    returns the shared batch, or ``None`` when they cannot share (one of them is
    missing, launches per layer, or covers other layers, or the activations are a
    tensor-parallel channel shard)."""
    acts = next((m for m in monitors if isinstance(m, ActivationsMonitor)), None)
    nonf = next((m for m in monitors if isinstance(m, NonFiniteMonitor)), None)
    if acts is None or nonf is None or acts._batch is None or nonf._batch is None:
        return None
    if acts._layers != nonf._layers:
        return None
    own_acts, own_nonf = acts._batch, nonf._batch
    width = acts._slots[acts._layers[0]].spec.size

    def single(layer: int, x):
        own_acts._single(layer, x)
        own_nonf._single(layer, x)

    shared = LayerBatch(
        acts._layers,
        SlotGroup(
            ctx.metrics,
            [c for i in acts._layers for c in (*acts.columns(i), nonf.column(i))],
        ),
        view=lambda x: (kernels.rows_view(x),),
        grouped=kernels.output_stats_partials_grouped,
        single=single,
        device=ctx.metrics.buffer.device,  # type: ignore[union-attr]
        accepts=lambda x: x.shape[1] == width and kernels.output_counts_exact(*x.shape),
        samples=lambda x: float(x.numel()),  # the moments' element count
    )
    acts.share(shared, partner=nonf)  # nonfinite's own callback runs only without it
    ctx.batches.append(shared)
    for site in ctx.model.layers:
        if getattr(site, "output_replica", False):
            continue  # not hooked (MonitorContext.attach_output)
        for handle in acts.output_handles.pop(site.index) + nonf.output_handles.pop(site.index):
            handle.remove()
            ctx.handles.remove(handle)
        hook = _shared_hook(
            ctx, acts, nonf, acts.output_records[site.index], nonf.output_records[site.index]
        )
        ctx.handles += site.attach_output(hook)
    return shared


def _shared_hook(
    ctx: MonitorContext,
    acts: ActivationsMonitor,
    nonf: NonFiniteMonitor,
    acts_record: Callable[[torch.Tensor], bool | None],
    nonf_record: Callable[[torch.Tensor], None],
) -> Callable[[torch.Tensor], None]:
    """One block's output callback for both monitors: the activations callback reads
    for both when both are active and it takes the shared read; otherwise each
    monitor's own callback runs."""
    clock = time.perf_counter_ns
    ledger = ctx.host_ns

    def record(hidden: torch.Tensor) -> None:
        a, n = acts.active, nonf.watching
        if not (a or n) and not capturing(hidden.is_cuda):
            return
        if torch.compiler.is_compiling():
            # Traced into the graph: no clock read, timing event or engine query (each
            # breaks it), and no read of the budget's timed set: dynamo guards on what the
            # trace reads, so that was one graph per set, the recompile limit within 60
            # steps on qwen3-1.7b (H200, 660156c), and the hook eager from then on.
            ctx.compiled = True  # replayed by dynamo after the graph: one store
            if not (a and acts_record(hidden)) and n:
                nonf_record(hidden)
            return
        if recomputing():  # an activation-checkpointing recompute: skipped, counted
            skips = ctx.recompute_skips
            for m in [acts.name] * a + [nonf.name] * n:
                skips[m] = skips.get(m, 0) + 1
            return
        if capturing(hidden.is_cuda):
            # Captured: both read, as when both run; the gates decide at each replay.
            ctx.graphed = True
            if not acts_record(hidden):
                nonf_record(hidden)
            return
        start = clock()
        budget = ctx.budget
        timed = budget is not None and (acts.name in budget.timing or nonf.name in budget.timing)
        span = budget.begin() if timed else None  # type: ignore[union-attr]
        if not (a and acts_record(hidden)) and n:
            nonf_record(hidden)
        if span is not None:  # the shared read's device time, half each when both ran
            for m in [acts.name] * a + [nonf.name] * n:
                budget.end(m, span, weight=1.0 / (a + n))  # type: ignore[union-attr]
        ns = clock() - start
        if a and n:
            ledger[acts.name] += ns // 2
            ledger[nonf.name] += ns - ns // 2
        else:
            ledger[acts.name if a else nonf.name] += ns

    return record
