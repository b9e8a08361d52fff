"""The gradient arriving at each block's output, every step, recorded in the backward.

A NaN is the last symptom: a loss or gradient-norm spike comes first, and it starts in
a layer. The norms monitor sees each layer's parameter gradients at its cadence; this
monitor sees the gradient flowing back through the residual stream, at every step,
with no sync: a tensor hook on each block output (syncless.monitors.adapters.sites,
``attach_output_grad``) reads the gradient once (syncless.kernels.gradients on CUDA:
one partials launch and one fold per layer) into three metrics per layer:

- ``monitors/layer_XX/grad_out_rms``: sqrt(mean g^2) over every element of the step,
  all micro-batches of an accumulated step (derived at flush from ``grad_out_sq``,
  the mean of g^2 with its exact element count);
- ``monitors/layer_XX/grad_out_absmax``: max |g|;
- ``monitors/layer_XX/grad_out_nonfinite_count``: NaN/Inf elements (the mean square
  and the max are over the finite elements, so they keep a scale at the step a NaN came).

Like the nonfinite alarm it records at every step (``always_on``: the budget takes its
cost as fixed, and plans only its readout). Each step the handle compares every
layer's RMS with its recent band (syncless.monitors.bands); the first step a layer
left it is ``monitors/layer_XX/grad_out_band_first_step``, from which a spike or a NaN
is attributed to the layer that moved first.

Layers are read one by one, as the backward reaches them: holding every layer's
gradient to read them in one launch would keep a step's worth of activation-sized
tensors alive that the backward frees as it goes.

Across ranks each element is counted once: every rank adds the elements it holds (its
batch, its sequence slice, a DTensor's local shard), and copies are left to one rank
(``LayerSite.output_replica``, a replicated DTensor off its mesh's first rank).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from syncless import kernels
from syncless.errors import UsageError
from syncless.graphs import capturing
from syncless.hot_path import hot_path
from syncless.metrics import Readout, Slot, layer_scope
from syncless.metrics.slot_group import Column, SlotGroup
from syncless.monitors.adapters import ModelMap
from syncless.monitors.adapters.sites import DTensor, own_elements
from syncless.monitors.bands import DEFAULT_BANDS, BandRule, LayerBands
from syncless.monitors.base import AREA, MonitorContext, check_every

SQ = "grad_out_sq"
ABSMAX = "grad_out_absmax"
NONFINITE = "grad_out_nonfinite_count"
BAND = "grad_out_band_first_step"


class GradientsMonitor:
    """Per layer, RMS, max |g| and NaN/Inf count of the gradient at the block output.

    ``every``: the readout's fastest cadence (the hooks record at every step).
    ``bands``: when a layer's RMS has left its recent band (``None``: no bands).
    """

    name = "gradients"
    always_on = True

    def __init__(self, every: int = 1, bands: BandRule | None = DEFAULT_BANDS) -> None:
        self.every = check_every(every)
        self.active = True
        self.watching = True  # False while the handle is paused
        self.band_rule = bands
        self.bands: LayerBands | None = None
        self._slots: dict[int, tuple[Slot, Slot, Slot]] = {}
        self._firsts: dict[int, Slot] = {}
        self._keys: list[tuple[int, str]] = []  # (layer, sq key) over every rank's layers

    def nothing_to_watch(self, model: ModelMap) -> str | None:
        return None if model.layers else "no transformer block the adapter found"

    def prepare(self, ctx: MonitorContext) -> None:
        declare = ctx.metrics.declare
        for site in ctx.model.layers:
            i = site.index
            self._slots[i] = (
                declare(AREA, SQ, "mean", layer=i),
                declare(AREA, ABSMAX, "max", layer=i),
                declare(AREA, NONFINITE, "sum", layer=i),
            )
            if self.band_rule is not None:
                self._firsts[i] = declare(AREA, BAND, "min", layer=i, derive_global=False)

    def attach(self, ctx: MonitorContext) -> None:
        self._keys = [(i, spec.key) for i, spec in ctx.metrics.layer_specs(AREA, SQ).items()]
        hooked: dict[int, Slot] = {}
        for site in ctx.model.layers:
            if getattr(site, "output_replica", False):  # another rank reads the same gradient
                continue
            sq, absmax, nonfinite = self._slots[site.index]
            group = SlotGroup(ctx.metrics, [Column(sq), Column(absmax), Column(nonfinite)])
            record = self._make_hook(site.index, sq, absmax, nonfinite, group)
            ctx.handles += site.attach_output_grad(ctx.timed(self.name, record, backward=True))
            hooked[site.index] = sq
        if self.band_rule is not None and hooked:
            firsts = {i: self._firsts[i] for i in hooked}
            self.bands = LayerBands(ctx.metrics, hooked, firsts, self.band_rule)
            ctx.bands.append(self.bands)

    def _make_hook(self, layer: int, sq: Slot, absmax: Slot, nonfinite: Slot, group: SlotGroup):
        @hot_path
        def record(grad: torch.Tensor) -> None:
            if not self.watching and not capturing(grad.is_cuda):
                return
            g = own_elements(grad.detach())
            if g is None:  # another rank's copy
                return
            if isinstance(g, DTensor):
                raise UsageError(
                    f"layer {layer}: the gradient at the block output is a partial sum "
                    f"({g.placements}): no rank holds its elements, and reading it would "
                    "take a collective in the hook"
                )
            n = g.numel()  # a shape: not a tensor value
            if kernels.use_triton(g):
                group.fold(kernels.grad_stats_partials(g, group.kernel_gate), n)
                return
            # As the kernel: the sum and the max over the finite elements, the rest counted
            finite = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)
            sq.add(torch.linalg.vector_norm(finite, dtype=torch.float32).square(), count=n)
            absmax.update(torch.linalg.vector_norm(finite, ord=float("inf"), dtype=torch.float32))
            nonfinite.add(torch.count_nonzero(g - g))

        return record

    def end_step(self) -> None:
        """A step that was not flushed: nothing to reset (no per-step alert)."""

    def derive(self, readout: Readout) -> dict[str, float]:
        out: dict[str, float] = {}
        rms = []
        for layer, key in self._keys:
            present = readout.present.get(key)
            if present is None or not present.all():
                continue
            value = float(readout.values[key][0])
            out[f"{AREA}/{layer_scope(layer)}/grad_out_rms"] = math.sqrt(value)
            rms.append(value)
        if rms:
            out[f"{AREA}/global/grad_out_rms_max"] = math.sqrt(float(np.max(rms)))
        return out

    def close(self) -> None:
        pass
