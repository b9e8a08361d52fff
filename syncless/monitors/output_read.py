"""One read of each layer output for the activations and nonfinite monitors together.

Both monitors read the same tensor, every block's output: apart, that is two hooks,
two grouped kernels and two folds per forward, and two passes over every activation.
When both are attached with grouped launches over the same layers, the activations
hook holds the output for both, one kernel computes the per-channel maxima and the
NaN/Inf counts in one pass (``kernels.output_stats_partials_grouped``) and one fold
updates both monitors' slots; the alert is updated from the same partials, as the
nonfinite monitor's own batch does.

Each monitor keeps its own cadence: a step where only one of them is active uses that
monitor's own batch. The per-layer fallback (see ``layer_batch``) runs both monitors'
own per-layer launches.
"""

from __future__ import annotations

from collections.abc import Sequence

from syncless import kernels
from syncless.metrics.slot_group import Column, SlotGroup
from syncless.monitors.activations import ActivationsMonitor
from syncless.monitors.base import Monitor, MonitorContext
from syncless.monitors.layer_batch import LayerBatch
from syncless.monitors.nonfinite import NonFiniteMonitor


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
    alert = nonf._alert
    assert alert is not None, "prepare() declared the alert"
    width = acts._slots[acts._layers[0]].spec.size

    def single(layer: int, x):
        own_acts._single(layer, x)
        own_nonf._single(layer, x)

    def alert_update(partials) -> None:
        # Every layer's count column: the largest per-layer count of this forward.
        alert.update(partials[:, width :: width + 1].sum(0).max())

    shared = LayerBatch(
        acts._layers,
        SlotGroup(
            ctx.metrics,
            [c for i in acts._layers for c in (Column(acts._slots[i]), Column(nonf._slots[i]))],
        ),
        view=lambda x: (kernels.rows_view(x),),
        grouped=kernels.output_stats_partials_grouped,
        single=single,
        device=ctx.metrics.buffer.device,  # type: ignore[union-attr]
        accepts=lambda x: x.shape[1] == width and kernels.output_counts_exact(*x.shape),
        after=alert_update,
    )
    acts.share(shared, partner=nonf)
    nonf.share(shared, partner=acts)
    ctx.batches.append(shared)
    return shared
