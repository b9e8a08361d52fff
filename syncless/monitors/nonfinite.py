"""NaN/Inf counts per layer output, and an on-device alert flag.

Hot path per layer: ``count_nonzero(x - x)`` (2 kernels, one read of the activation)
and the slot ops (2 for the count, 2 for the alert); on CUDA two launches per forward
for all layers together, the alert included (grouped, the default: syncless.monitors.
layer_batch; shared with the activations monitor's read when both are attached:
syncless.monitors.output_read), which then lands once the forward has passed the last
layer: still before backward and the optimizer step; ``launch="layer"``: two fused
launches per layer. The alert, ``monitors/step/nonfinite_alert_count``
(the largest per-layer count this step), is a max metric in the same packed buffer: it
rides in the flush's one D2H copy, and ``alert`` is its device tensor, which training
code may use on the device (e.g. ``torch.where`` to skip an update) without a sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

from syncless import kernels
from syncless.hot_path import hot_path
from syncless.metrics import Readout, Slot
from syncless.metrics.slot_group import Column, SlotGroup
from syncless.monitors.base import AREA, MonitorContext, check_every
from syncless.monitors.layer_batch import LayerBatch, launch_mode


class NonFiniteMonitor:
    name = "nonfinite"

    def __init__(self, every: int = 1, launch: str | None = None) -> None:
        self.every = check_every(every)
        self.active = True
        self.launch = launch_mode(launch)  # "grouped": syncless.monitors.layer_batch
        self._slots: dict[int, Slot] = {}
        self._alert: Slot | None = None
        self._batch: LayerBatch | None = None
        self._layers: list[int] = []
        # Per layer: the output callback and the hook handles that call it (attach);
        # output_read replaces the handles with one hook shared with the partner.
        self.output_records: dict[int, Callable[[torch.Tensor], None]] = {}
        self.output_handles: dict[int, list[RemovableHandle]] = {}

    def prepare(self, ctx: MonitorContext) -> None:
        for site in ctx.model.layers:
            self._slots[site.index] = ctx.metrics.declare(
                AREA, "nonfinite_count", "sum", layer=site.index
            )
            self._layers.append(site.index)
        self._alert = ctx.metrics.declare(AREA, "nonfinite_alert_count", "max")

    @property
    def alert(self) -> torch.Tensor:
        """The device view of this step's alert value (-inf until something is recorded)."""
        assert self._alert is not None and self._alert._max is not None, "allocate() first"
        return self._alert._max

    def attach(self, ctx: MonitorContext) -> None:
        alert = self._alert
        assert alert is not None
        groups: dict[int, SlotGroup] = {}
        for site in ctx.model.layers:
            slot = self._slots[site.index]
            groups[site.index] = SlotGroup(ctx.metrics, [Column(slot, also_max=alert)])
            ctx.attach_output(self, site, self._make_output_hook(site.index, slot, groups))
        if self.launch == "grouped" and self._layers:
            # The grouped fold sums each layer's column and feeds every column's sum to
            # the alert (the largest per-layer count of the forward) by an atomic max:
            # no launch more for it (it was four: sum, max, where, clamp).
            self._batch = LayerBatch(
                self._layers,
                SlotGroup(
                    ctx.metrics, [Column(self._slots[i], also_max=alert) for i in self._layers]
                ),
                view=lambda x: (kernels.flat_view(x),),
                grouped=kernels.nonfinite_partials_grouped,
                single=lambda layer, x: groups[layer].fold(kernels.nonfinite_partials(x), 1),
                device=ctx.metrics.buffer.device,  # type: ignore[union-attr]
            )
            ctx.batches.append(self._batch)

    def _make_output_hook(self, layer: int, slot: Slot, groups: dict[int, SlotGroup]):
        alert = self._alert
        assert alert is not None

        @hot_path
        def record(hidden: torch.Tensor) -> None:
            if not self.active:
                return
            # x - x is 0 for every finite x and NaN for NaN and +-inf: 2 kernels, where
            # isfinite().logical_not().sum() decomposes into 6 (abs, ne, eq, mul, ...).
            if kernels.use_triton(hidden):
                if self._batch is not None:  # the site's hook detached ``hidden``
                    # (sharing, output_read calls this only when the activations
                    # callback did not read for both)
                    self._batch.add(layer, hidden)
                    return
                groups[layer].fold(kernels.nonfinite_partials(hidden.detach()), 1)
                return
            h = hidden.detach()
            bad = torch.count_nonzero(h - h)
            slot.add(bad)
            alert.update(bad)

        return record

    def derive(self, readout: Readout) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
