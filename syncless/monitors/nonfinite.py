"""NaN/Inf counts per layer output, and an on-device alert flag.

Hot path per layer: ``count_nonzero(x - x)`` (2 kernels, one read of the activation)
and the slot ops (2 for the count, 2 for the alert). The alert, ``monitors/step/nonfinite_alert_count``
(the largest per-layer count this step), is a max metric in the same packed buffer: it
rides in the flush's one D2H copy, and ``alert`` is its device tensor, which training
code may use on the device (e.g. ``torch.where`` to skip an update) without a sync.
"""

from __future__ import annotations

import torch

from syncless import kernels
from syncless.hot_path import hot_path
from syncless.metrics import Readout, Slot
from syncless.metrics.slot_group import Column, SlotGroup
from syncless.monitors.base import AREA, MonitorContext, check_every


class NonFiniteMonitor:
    name = "nonfinite"

    def __init__(self, every: int = 1) -> None:
        self.every = check_every(every)
        self.active = True
        self._slots: dict[int, Slot] = {}
        self._alert: Slot | None = None

    def prepare(self, ctx: MonitorContext) -> None:
        for site in ctx.model.layers:
            self._slots[site.index] = ctx.metrics.declare(
                AREA, "nonfinite_count", "sum", layer=site.index
            )
        self._alert = ctx.metrics.declare(AREA, "nonfinite_alert_count", "max")

    @property
    def alert(self) -> torch.Tensor:
        """The device view of this step's alert value (-inf until something is recorded)."""
        assert self._alert is not None and self._alert._max is not None, "allocate() first"
        return self._alert._max

    def attach(self, ctx: MonitorContext) -> None:
        for site in ctx.model.layers:
            slot = self._slots[site.index]
            group = SlotGroup(ctx.metrics, [Column(slot, also_max=self._alert)])
            ctx.handles += site.attach_output(
                ctx.timed(self.name, self._make_output_hook(slot, group))
            )

    def _make_output_hook(self, slot: Slot, group: SlotGroup):
        alert = self._alert
        assert alert is not None

        @hot_path
        def record(hidden: torch.Tensor) -> None:
            if not self.active:
                return
            # x - x is 0 for every finite x and NaN for NaN and +-inf: 2 kernels, where
            # isfinite().logical_not().sum() decomposes into 6 (abs, ne, eq, mul, ...).
            h = hidden.detach()
            if kernels.use_triton(h):
                group.fold(kernels.nonfinite_partials(h), 1)
                return
            bad = torch.count_nonzero(h - h)
            slot.add(bad)
            alert.update(bad)

        return record

    def derive(self, readout: Readout) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
