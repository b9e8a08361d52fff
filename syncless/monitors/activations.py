"""Massive activations: per-channel running max |x| of each layer's output, and its RMS
and kurtosis.

Hot path, per layer and step: one read of the activation (fused on CUDA: the per-channel
max |x| and the sums of x^2 and x^4 in one kernel, one fold), folded into the layer's
per-channel max and its two moments, ``act_m2`` and ``act_m4`` (means of x^2 and x^4
with the exact element count). Everything else (the largest channel, max/median ratio,
channels above each threshold, ``act_rms`` = sqrt(m2), ``act_kurtosis`` = m4 / m2^2 - 3,
about 0 for a Gaussian) is derived at flush from the cluster-wide values. Each active
step also compares every layer's RMS with its recent band (syncless.monitors.bands),
for the attribution of a spike or a NaN to the layer that moved first.

Tensor parallelism: when the channel dimension is sharded, pass ``channel_shard=(rank,
world)``. Each rank then folds its channels into its own slice of the full-width vector
and leaves the rest at the max identity, so the flush's packed MAX collective assembles
the whole vector: no collective of its own on the hot path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from syncless import kernels
from syncless.graphs import capturing
from syncless.hot_path import hot_path
from syncless.metrics import Readout, Slot, layer_scope
from syncless.metrics.slot_group import Column, SlotGroup
from syncless.monitors.adapters import ModelMap
from syncless.monitors.bands import DEFAULT_BANDS, BandRule, LayerBands
from syncless.monitors.base import AREA, MonitorContext, check_every
from syncless.monitors.layer_batch import LayerBatch, launch_mode

NAME = "act_channel_absmax"
M2 = "act_m2"
M4 = "act_m4"
BAND = "act_band_first_step"


def _threshold_label(t: float) -> str:
    return f"{t:g}".replace(".", "p").replace("+", "")


class ActivationsMonitor:
    name = "activations"

    def __init__(
        self,
        every: int = 1,
        thresholds: Sequence[float] = (20.0, 100.0, 500.0),
        channel_shard: tuple[int, int] | None = None,
        launch: str | None = None,
        bands: BandRule | None = DEFAULT_BANDS,
    ) -> None:
        self.every = check_every(every)
        self.band_rule = bands
        self.bands: LayerBands | None = None
        # per layer: the moments' slots (mean of x^2, of x^4) and the band's first step
        self._moments: dict[int, tuple[Slot, Slot]] = {}
        self._firsts: dict[int, Slot] = {}
        self._moment_keys: list[tuple[int, str, str]] = []  # every rank's (layer, m2, m4)
        self.launch = launch_mode(launch)  # "grouped": syncless.monitors.layer_batch
        self.active = True
        self.thresholds = tuple(sorted(float(t) for t in thresholds))
        self.channel_shard = channel_shard
        self._slots: dict[int, Slot] = {}
        self._layers: list[int] = []  # the layers this rank holds
        # Derive's tables over every rank's layers (attach): each layer's channel key,
        # and its derived names (absmax, ratio, one count per threshold).
        self._channel_keys: tuple[str, ...] = ()
        self._derived_names: list[list[str]] = []
        self._batch: LayerBatch | None = None
        # One read shared with the nonfinite monitor (syncless.monitors.output_read).
        self._shared: LayerBatch | None = None
        self._partner: Any = None
        # Per layer: the output callback and the hook handles that call it (attach);
        # output_read replaces the handles with one hook shared with the partner.
        self.output_records: dict[int, Callable[[torch.Tensor], bool | None]] = {}
        self.output_handles: dict[int, list[RemovableHandle]] = {}

    def share(self, batch: LayerBatch, partner: Any) -> None:
        """Read each output for ``partner`` too, through ``batch``, on steps where it is
        active as well (``syncless.monitors.output_read``)."""
        self._shared, self._partner = batch, partner

    def nothing_to_watch(self, model: ModelMap) -> str | None:
        """Why this model gives the monitor nothing to record, or None."""
        return None if model.layers else "no transformer block the adapter found"

    def prepare(self, ctx: MonitorContext) -> None:
        width = ctx.model.d_model
        for site in ctx.model.layers:
            self._slots[site.index] = ctx.metrics.declare(
                AREA, NAME, "max", size=width, layer=site.index, element="channel",
                emit_elements=False,
            )  # fmt: skip
            self._moments[site.index] = (
                ctx.metrics.declare(AREA, M2, "mean", layer=site.index),
                ctx.metrics.declare(AREA, M4, "mean", layer=site.index),
            )
            if self.band_rule is not None:
                self._firsts[site.index] = ctx.metrics.declare(
                    AREA, BAND, "min", layer=site.index, derive_global=False
                )
            self._layers.append(site.index)

    def columns(self, layer: int, channels: Slot | None = None) -> list[Column]:
        """Layer ``layer``'s columns in a fold, as the kernels write them: the channel
        maxima (``channels``: a tensor-parallel rank's slice), then the two moments."""
        m2, m4 = self._moments[layer]
        return [Column(channels or self._slots[layer]), Column(m2), Column(m4)]

    def attach(self, ctx: MonitorContext) -> None:
        # Over every rank's layers (the allocated union): pipeline stages hold other
        # layers, and rank 0 derives for all of them. Thresholds agree across ranks.
        specs = ctx.metrics.layer_specs(AREA, NAME)
        self._channel_keys = tuple(spec.key for spec in specs.values())
        counts = [f"act_channels_above_{_threshold_label(t)}_count" for t in self.thresholds]
        names = ("act_absmax", "act_max_median_ratio", *counts)  # derive's table order
        self._derived_names = [
            [f"{AREA}/{spec.scope}/{n}" for n in names] for spec in specs.values()
        ]
        self._moment_keys = [
            (layer, spec.key, ctx.metrics.layer_specs(AREA, M4)[layer].key)
            for layer, spec in ctx.metrics.layer_specs(AREA, M2).items()
        ]
        groups: dict[int, SlotGroup] = {}
        hooked: list[int] = []
        for site in ctx.model.layers:
            slot = self._slots[site.index]
            if self.channel_shard is not None:  # this rank's slice of the channels
                rank, world = self.channel_shard
                width = slot.spec.size // world
                slot = slot.narrow(rank * width, width)
            groups[site.index] = SlotGroup(ctx.metrics, self.columns(site.index, slot))
            ctx.attach_output(self, site, self._make_output_hook(site.index, slot, groups))
            if not getattr(site, "output_replica", False):
                hooked.append(site.index)

        def single(layer: int, x: torch.Tensor) -> None:
            group = groups[layer]
            group.fold(kernels.channel_absmax_partials(x, group.kernel_gate), x.numel())

        if self.launch == "grouped" and self.channel_shard is None and self._layers:
            self._batch = LayerBatch(
                self._layers,
                SlotGroup(ctx.metrics, [c for i in self._layers for c in self.columns(i)]),
                view=lambda x: (kernels.rows_view(x),),
                grouped=kernels.channel_absmax_partials_grouped,
                single=single,
                device=ctx.metrics.buffer.device,  # type: ignore[union-attr]
                samples=lambda x: float(x.numel()),
            )
            ctx.batches.append(self._batch)
        if self.band_rule is not None and hooked:
            self.bands = LayerBands(
                ctx.metrics,
                {i: self._moments[i][0] for i in hooked},
                {i: self._firsts[i] for i in hooked},
                self.band_rule,
            )
            ctx.bands.append(self.bands)

    def _make_output_hook(self, layer: int, slot, groups: dict[int, SlotGroup]):
        @hot_path
        def record(hidden: torch.Tensor) -> bool | None:
            """True when the output was read for the partner monitor too."""
            if not self.active and not capturing(hidden.is_cuda):
                return None
            if kernels.use_triton(hidden):
                if self._batch is not None:  # the site's hook detached ``hidden``
                    shared = self._shared
                    partner = self._partner
                    if shared is not None and (partner.watching or capturing(hidden.is_cuda)):
                        shared.add(layer, hidden)  # read once for both monitors
                        return True
                    self._batch.add(layer, hidden)
                    return None
                x = hidden.detach()
                group = groups[layer]
                group.fold(kernels.channel_absmax_partials(x, group.kernel_gate), x.numel())
                return None
            x = hidden.detach()
            dims = tuple(range(x.dim() - 1))
            slot.update(torch.linalg.vector_norm(x, ord=float("inf"), dim=dims))
            m2, m4 = self._moments[layer]
            squares = x.float().square()
            m2.add(squares.sum(), count=x.numel())
            m4.add(squares.square().sum(), count=x.numel())
            return None

        return record

    def derive(self, readout: Readout) -> dict[str, float]:
        """Per layer: largest channel, max/median ratio, channels above each threshold.

        One numpy pass over the stacked ``[layers, channels]`` maxima (a view of the
        readout when the layers' vectors sit back to back); per-layer loops cost ~1 ms
        per flush on the demo's large preset, on the training thread.
        """
        if not self._channel_keys:
            return {}
        channels, present = readout.stack(self._channel_keys)
        full = present.all(axis=1)  # a layer no forward recorded in this step is skipped
        if not full.any():
            return {}
        rows = np.flatnonzero(full)
        if len(rows) < len(full):
            channels = channels[rows]
        top = channels.max(axis=1)
        median = _row_medians(channels)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(median > 0, top / median, np.inf)
        # One count per threshold: summing a [layers, channels, thresholds] bool array
        # over its middle axis took 0.6 ms per flush on the demo large schema, this 0.04.
        above = [np.count_nonzero(channels > t, axis=1) for t in self.thresholds]
        table = np.stack([top, ratio, *above], axis=1).astype(np.float64)
        names = self._derived_names
        keys = [n for r in rows.tolist() for n in names[r]]
        out = dict(zip(keys, table.ravel().tolist(), strict=True))
        out[f"{AREA}/global/act_absmax"] = float(top.max())
        out.update(self._moment_records(readout))
        return out

    def _moment_records(self, readout: Readout) -> dict[str, float]:
        """``act_rms`` and ``act_kurtosis`` of every layer with both moments."""
        out: dict[str, float] = {}
        for layer, m2_key, m4_key in self._moment_keys:
            present = readout.present
            if not (present[m2_key].all() and present[m4_key].all()):
                continue
            m2 = float(readout.values[m2_key][0])
            m4 = float(readout.values[m4_key][0])
            scope = f"{AREA}/{layer_scope(layer)}"
            out[f"{scope}/act_rms"] = math.sqrt(m2) if m2 >= 0 else math.nan
            out[f"{scope}/act_kurtosis"] = m4 / (m2 * m2) - 3.0 if m2 > 0 else math.nan
        return out

    def close(self) -> None:
        pass


def _row_medians(x: np.ndarray) -> np.ndarray:
    """``np.median(x, axis=1)`` (NaN where a row has one) from one partition: the same
    values without ``np.median``'s import of ``numpy.ma`` at its first call (a module
    import inside whichever training step's flush comes first)."""
    n = x.shape[1]
    k = n // 2
    if n % 2:
        median = np.partition(x, k, axis=1)[:, k]
    else:
        part = np.partition(x, (k - 1, k), axis=1)
        median = (part[:, k - 1] + part[:, k]) / 2
    median[np.isnan(x).any(axis=1)] = np.nan
    return median
