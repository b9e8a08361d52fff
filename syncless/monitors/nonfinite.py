"""NaN/Inf counts per layer output, every step, and the first step and layer that had one.

An alarm, not a statistic: the other monitors' cadences follow the overhead budget,
this one's hooks record at every step (``always_on``), so a NaN in a single step, the
first step of a divergence or one overflowing bf16 activation is never missed. Only
its readout follows the budget: the counts add up on the device between flushes, and
the first step a layer saw a nonfinite value (``nonfinite_first_step``, a min metric
the fold writes from ``MetricSet.step_label``) stays there until the next readout, so
nothing is read on the host in a hook. A 12-step tiny Llama with a NaN planted at step
7 under the default budget had no record of it before (issue #35: active at 0, 1, 4,
10).

Hot path per layer: ``count_nonzero(x - x)`` (2 kernels, one read of the activation)
and the slot ops on a CPU; on CUDA two launches per forward for all layers together,
the alert and the first step included (grouped, the default: syncless.monitors.
layer_batch; shared with the activations monitor's read when both run that step:
syncless.monitors.output_read). The alert, ``monitors/step/nonfinite_alert_count``
(the largest per-layer count of the current step), is a max metric reset at every
step end: ``alert`` is its device tensor, which training code may use on the device
(e.g. ``torch.where`` to skip an update) without a sync.

``check_values`` (``handle.step(step, loss=, grad_norm=)``) checks a scalar the step
produced the same way: one partials launch and one fold each on CUDA; and, with
``spikes`` (the default), whether it is a spike against its last finite values
(syncless.monitors.spikes): one launch more each, the device's ring and counts only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from syncless import kernels
from syncless.graphs import capturing
from syncless.hot_path import hot_path
from syncless.metrics import Readout, Slot
from syncless.metrics.slot_group import Column, SlotGroup
from syncless.monitors.adapters import ModelMap
from syncless.monitors.base import AREA, MonitorContext, check_every
from syncless.monitors.layer_batch import LayerBatch, launch_mode
from syncless.monitors.spikes import DEFAULT_SPIKES, SpikeRule, ValueSpikes

#: Scalars ``handle.step`` may hand over for an every-step check.
CHECKED_VALUES = ("loss", "grad_norm")


class NonFiniteMonitor:
    name = "nonfinite"
    # Hooks record at every step; ``every``/``active`` pace only the readout (the
    # budget plans it from the flush's cost) and the handle bills the hooks as a
    # fixed cost per step (syncless.monitors.budget).
    always_on = True

    def __init__(
        self,
        every: int = 1,
        launch: str | None = None,
        spikes: SpikeRule | Mapping[str, SpikeRule] | None = DEFAULT_SPIKES,
    ) -> None:
        self.every = check_every(every)
        # value -> its rule (one rule for both; None: no spike check)
        self.spike_rules: dict[str, SpikeRule] = (
            {}
            if spikes is None
            else dict.fromkeys(CHECKED_VALUES, spikes)
            if isinstance(spikes, SpikeRule)
            else dict(spikes)
        )
        self._spike_slots: dict[str, tuple[Slot, Slot]] = {}  # value -> count, first step
        self.spikes: dict[str, ValueSpikes] = {}
        self.active = True
        self.watching = True  # False while the handle is paused
        self.launch = launch_mode(launch)  # "grouped": syncless.monitors.layer_batch
        self._slots: dict[int, Slot] = {}
        self._firsts: dict[int, Slot] = {}
        self._alert: Slot | None = None
        self._values: dict[str, tuple[Slot, Slot]] = {}  # loss/grad_norm: count, first
        self._value_groups: dict[str, SlotGroup] = {}
        self._step_label: torch.Tensor | None = None
        self._batch: LayerBatch | None = None
        self._layers: list[int] = []
        self._first_keys: tuple[str, ...] = ()  # every layer's, all ranks' (attach)
        # Per layer: the output callback and the hook handles that call it (attach);
        # output_read replaces the handles with one hook shared with the partner.
        self.output_records: dict[int, Callable[[torch.Tensor], None]] = {}
        self.output_handles: dict[int, list[RemovableHandle]] = {}

    def nothing_to_watch(self, model: ModelMap) -> str | None:
        """Never idle: without layers it still checks the loss and gradient norm that
        ``handle.step`` is given."""
        return None

    def prepare(self, ctx: MonitorContext) -> None:
        for site in ctx.model.layers:
            self._slots[site.index] = ctx.metrics.declare(
                AREA, "nonfinite_count", "sum", layer=site.index
            )
            # derive_global=False: the step-wide first step and layer are derived
            # together (``derive``), the layer from the same values.
            self._firsts[site.index] = ctx.metrics.declare(
                AREA, "nonfinite_first_step", "min", layer=site.index, derive_global=False
            )
            self._layers.append(site.index)
        self._alert = ctx.metrics.declare(AREA, "nonfinite_alert_count", "max")
        for value in CHECKED_VALUES:
            self._values[value] = (
                ctx.metrics.declare(AREA, f"{value}_nonfinite_count", "sum"),
                ctx.metrics.declare(AREA, f"{value}_nonfinite_first_step", "min"),
            )
            if value in self.spike_rules:
                self._spike_slots[value] = (
                    ctx.metrics.declare(AREA, f"{value}_spike_count", "sum"),
                    ctx.metrics.declare(AREA, f"{value}_spike_first_step", "min"),
                )

    @property
    def alert(self) -> torch.Tensor:
        """The device view of this step's alert value (-inf until something is recorded)."""
        assert self._alert is not None and self._alert._max is not None, "allocate() first"
        return self._alert._max

    def attach(self, ctx: MonitorContext) -> None:
        alert = self._alert
        assert alert is not None
        self._step_label = ctx.metrics.step_label
        first_specs = ctx.metrics.layer_specs(AREA, "nonfinite_first_step")
        self._first_keys = tuple(spec.key for spec in first_specs.values())
        groups: dict[int, SlotGroup] = {}
        self._value_groups = {
            value: SlotGroup(ctx.metrics, [Column(count, first=first)])
            for value, (count, first) in self._values.items()
        }
        self.spikes = {
            value: ValueSpikes(ctx.metrics, count, first, self.spike_rules[value])
            for value, (count, first) in self._spike_slots.items()
        }
        for site in ctx.model.layers:
            slot = self._slots[site.index]
            groups[site.index] = SlotGroup(ctx.metrics, [self.column(site.index)])
            ctx.attach_output(self, site, self._make_output_hook(site.index, slot, groups))
        if self.launch == "grouped" and self._layers:
            # The grouped fold sums each layer's column, feeds every column's sum to
            # the alert (the largest per-layer count of the forward) by an atomic max
            # and writes the step into the layers that counted one: no launch more.
            self._batch = LayerBatch(
                self._layers,
                SlotGroup(ctx.metrics, [self.column(i) for i in self._layers]),
                view=lambda x: (kernels.flat_view(x),),
                grouped=kernels.nonfinite_partials_grouped,
                single=lambda layer, x: groups[layer].fold(
                    kernels.nonfinite_partials(x, groups[layer].kernel_gate), 1
                ),
                device=ctx.metrics.buffer.device,  # type: ignore[union-attr]
            )
            ctx.batches.append(self._batch)

    def column(self, layer: int) -> Column:
        """Layer ``layer``'s count column in a fold: the alert and its first step too."""
        return Column(self._slots[layer], also_max=self._alert, first=self._firsts[layer])

    def _make_output_hook(self, layer: int, slot: Slot, groups: dict[int, SlotGroup]):
        alert, first = self._alert, self._firsts[layer]
        assert alert is not None

        @hot_path
        def record(hidden: torch.Tensor) -> None:
            if not self.watching and not capturing(hidden.is_cuda):
                return
            # x - x is 0 for every finite x and NaN for NaN and +-inf: 2 kernels, where
            # isfinite().logical_not().sum() decomposes into 6 (abs, ne, eq, mul, ...).
            if kernels.use_triton(hidden):
                if self._batch is not None:  # the site's hook detached ``hidden``
                    # (sharing, output_read calls this only when the activations
                    # callback did not read for both)
                    self._batch.add(layer, hidden)
                    return
                group = groups[layer]
                group.fold(kernels.nonfinite_partials(hidden.detach(), group.kernel_gate), 1)
                return
            alert.update(self._count(hidden.detach(), slot, first))

        return record

    @hot_path
    def _count(self, x: torch.Tensor, count: Slot, first: Slot) -> torch.Tensor:
        """The torch path: ``x``'s NaN/Inf count, and the step if there is one."""
        bad = torch.count_nonzero(x - x)
        count.add(bad)
        first.update(torch.where(bad > 0, self._step_label, torch.inf))  # type: ignore[arg-type]
        return bad

    @hot_path
    def check_values(self, values: dict[str, torch.Tensor]) -> None:
        """Count NaN/Inf in the step's ``loss``/``grad_norm`` (device tensors)."""
        if not self.watching:
            return
        for name, x in values.items():
            x = x.detach()
            if kernels.use_triton(x):
                group = self._value_groups[name]
                group.fold(kernels.nonfinite_partials(x, group.kernel_gate), 1)
            else:
                self._count(x, *self._values[name])
            spikes = self.spikes.get(name)
            if spikes is not None:
                spikes.update(x)

    def end_step(self) -> None:
        """A step that was not flushed: the alert starts the next step afresh (a flush
        resets the whole buffer)."""
        if self._alert is not None and self._alert._max is not None:
            self._alert._max.fill_(-torch.inf)

    def derive(self, readout: Readout) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._first_keys:
            firsts, present = readout.stack(self._first_keys)
            found = first_bad(firsts[:, 0], present[:, 0])
            if found is not None:
                step, at = found
                out[f"{AREA}/step/nonfinite_first_step"] = step
                out[f"{AREA}/step/nonfinite_first_layer"] = float(layer_of(self._first_keys[at]))
        return out

    def close(self) -> None:
        pass


def first_bad(steps: np.ndarray, present: np.ndarray) -> tuple[float, int] | None:
    """The earliest step among present elements and the first element (layer order)
    that has it, or None when none is present."""
    if not present.any():
        return None
    earliest = steps[present].min()
    at = int(np.flatnonzero(present & (steps == earliest))[0])
    return float(earliest), at


def layer_of(key: str) -> int:
    """``monitors/layer_07/...`` -> 7."""
    return int(key.split("/")[1].removeprefix("layer_"))
