"""Attention: per layer and head, the max QK logit and the softmax entropy.

Metrics (per layer with attention, one element per query head; docs/monitors/attention.md):

* ``monitors/layer_XX/attn_qk_logit_max`` (max, dimensionless): the largest ``q·k *
  scale`` over every allowed (query, key) pair, causal mask and sliding window respected.
* ``monitors/layer_XX/attn_entropy_nats`` (mean, nats): the mean over query rows of the
  softmax row entropy ``-Σ_j p_ij ln p_ij``, count-weighted across calls and ranks.
* ``monitors/step/attn_sampled_frac`` (mean, fraction): query rows used / rows seen,
  over every layer, call and rank; 1.0 means every statistic is exact.

The logits are computed from q and k as the model's attention saw them: rounded to the
autocast dtype when the forward runs under autocast (SDPA casts float32 q/k to it), with
float32 accumulation and float32/64 statistics. On CUDA (Triton) one grouped launch per
forward reads every layer (``syncless.kernels.attention``); a site that hands q/k before
their rotary embedding (the Hugging Face adapter) has k rotated by one small launch per
layer and q rotated inside the statistics kernel. The torch fallback materialises the
logits of the rows it uses (13 kernels per layer, float32): above ``max_elements``
logits it uses every ``stride``-th query row (:mod:`syncless.monitors.attention_stats`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from syncless import kernels
from syncless.errors import UsageError
from syncless.graphs import capturing
from syncless.hot_path import hot_path
from syncless.metrics import Readout, Slot
from syncless.metrics.slot_group import Column, SlotGroup
from syncless.monitors.adapters import AttentionSite, ModelMap, Rotary
from syncless.monitors.attention_stats import (
    DEFAULT_FUSED_MAX_ELEMENTS,
    DEFAULT_MAX_ELEMENTS,
    PlanCache,
    RowPlan,
    check_lengths,
    measure_sampled_traced,
    qk_stats,
    row_stride,
)
from syncless.monitors.base import AREA, MonitorContext, check_every
from syncless.monitors.layer_batch import LayerBatch, launch_mode

LOGIT_MAX = "attn_qk_logit_max"
ENTROPY = "attn_entropy_nats"
SAMPLED_FRAC = "attn_sampled_frac"


class AttentionMonitor:
    """Max QK logit and attention entropy per layer and query head.

    ``every``: record every N steps. ``max_elements``: the largest ``B * H * n * Lk``
    logits tensor one hook may materialise (float32, so 4 bytes each, twice at the
    softmax); above it the query rows are sampled with a stride (docs/monitors/attention.md).
    ``fused_max_elements``: the same bound for the fused Triton kernel, which never
    materialises logits, so it bounds time, not memory. The default is exact at any
    shape a GPU trains (``2**40`` logits): the kernel runs near the hardware's floor, and
    the handle's overhead budget (``attach(..., budget=)``) sets how often it runs;
    lower it to trade exactness of every active step for rows sampled at a rotating
    phase.
    """

    name = "attention"

    def __init__(
        self,
        every: int = 1,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        launch: str | None = None,
        fused_max_elements: int = DEFAULT_FUSED_MAX_ELEMENTS,
    ) -> None:
        if max_elements < 1 or fused_max_elements < 1:
            raise ValueError(
                f"max_elements and fused_max_elements must be >= 1, got {max_elements} "
                f"and {fused_max_elements}"
            )
        self.fused_max_elements = fused_max_elements
        self.every = check_every(every)
        self.active = True
        self.launch = launch_mode(launch)  # "grouped": syncless.monitors.layer_batch
        self._batch: LayerBatch | None = None
        self.max_elements = max_elements
        self.plans = PlanCache(max_elements)
        self._recorders: dict[int, _LayerRecorder] = {}  # the layers this rank holds
        self._groups: list[_HeadGroup] = []  # derive's tables, over every rank's layers
        self._frac: Slot | None = None

    def nothing_to_watch(self, model: ModelMap) -> str | None:
        """Why this model gives the monitor nothing to record, or None."""
        if model.attention:
            return None
        return "no attention module whose q and k the adapter can read"

    def prepare(self, ctx: MonitorContext) -> None:
        for site in ctx.model.attention:
            _check_site(site)
            # Every head of the layer: a tensor-parallel rank records its slice, and the
            # flush's reduce assembles the others' (neutral elements stay absent).
            heads = site.global_heads
            logit_max = ctx.metrics.declare(
                AREA, LOGIT_MAX, "max", size=heads, layer=site.layer, element="head"
            )
            entropy = ctx.metrics.declare(
                AREA, ENTROPY, "mean", size=heads, layer=site.layer, element="head"
            )
            self._recorders[site.layer] = _LayerRecorder(self, site, logit_max, entropy)
        if self._recorders:
            self._frac = ctx.metrics.declare(AREA, SAMPLED_FRAC, "mean")

    def attach(self, ctx: MonitorContext) -> None:
        assert self._frac is not None or not self._recorders
        self._groups = _head_groups(ctx)
        for site in ctx.model.attention:
            recorder = self._recorders[site.layer]
            recorder.frac = self._frac
            # This rank's heads: its slice of the layer's (all of them without TP).
            recorder.logit_max = recorder.logit_max.narrow(site.head_offset, site.n_heads)
            recorder.entropy = recorder.entropy.narrow(site.head_offset, site.n_heads)
            recorder.group = SlotGroup(
                ctx.metrics,
                [Column(recorder.logit_max), Column(recorder.entropy), Column(self._frac)],
            )
            ctx.handles += site.attach_qk_rotary(ctx.timed(self.name, recorder.record))
        recorders = [self._recorders[site.layer] for site in ctx.model.attention]
        if self.launch == "grouped" and len({r.statics for r in recorders}) == 1:
            self._batch = self._grouped_batch(ctx, recorders)
            ctx.batches.append(self._batch)

    def _grouped_batch(self, ctx: MonitorContext, recorders: list[_LayerRecorder]) -> LayerBatch:
        """Every layer's q/k in one launch, in exact mode (a sampled shape, with its
        rotating phase per layer, takes the per-layer path)."""
        first = recorders[0]
        n_heads, scale, causal, window = first.n_heads, first.scale, first.causal, first.window
        frac = self._frac
        assert frac is not None
        by_layer = {r.layer: r for r in recorders}

        def exact(q: torch.Tensor, k: torch.Tensor, *rope: torch.Tensor) -> bool:
            batch, _, q_len, _ = q.shape
            return row_stride(batch, n_heads, q_len, k.shape[2], self.fused_max_elements) == 1

        def grouped(
            q: torch.Tensor, k: torch.Tensor, *rest: torch.Tensor | int, gate: torch.Tensor | None
        ):
            # (q, k, offsets, n) or, for unrotated q, (q, k, cos, sin, offsets, n)
            *rope, offsets, n = rest
            return kernels.qk_stats_partials_grouped(
                q, k, offsets, n, scale, causal, window,  # type: ignore[arg-type]
                q_rope=tuple(rope) or None, compute_dtype=first.compute,  # type: ignore[arg-type]
                gate=gate,
            )  # fmt: skip

        n_layers = len(recorders)
        frac.prepare_add_ones()

        def rows_used(partials: torch.Tensor, rows: float) -> None:
            # Exact mode: every row seen is used, so the shared fraction gets the rows
            # of all layers as both its sum and its count: one update, not L racing,
            # and one launch (the rows are host shapes, not read from the partials).
            frac.add_ones(rows * n_layers)

        # Each layer's 2H + 1 columns: its max logits and entropy sums are folded; its
        # rows-used column is not (the shared fraction is updated once, above).
        columns = [
            c
            for r in recorders
            for c in (Column(r.logit_max), Column(r.entropy), Column(None, width=1))
        ]
        return LayerBatch(
            [r.layer for r in recorders],
            SlotGroup(ctx.metrics, columns),
            view=lambda *qk: qk,
            grouped=grouped,
            single=lambda layer, *qk: by_layer[layer].record_fused(*qk),
            device=ctx.metrics.buffer.device,  # type: ignore[union-attr]
            accepts=exact,
            after=rows_used,
            samples=lambda q, *rest: q.shape[0] * q.shape[2],
            tensors=4 if first.rotary_inputs else 2,
            defer_fold=True,  # nothing reads these slots before the flush
        )

    def derive(self, readout: Readout) -> dict[str, float]:
        """The layer with the largest logit, and the lowest head entropy of any layer.

        Recorded NaNs are skipped here (the per-layer records keep them); a layer with
        nothing else is not a candidate.
        """
        out: dict[str, float] = {}
        layers: list[int] = []
        tops: list[np.ndarray] = []
        lowest: list[float] = []
        for group in self._groups:
            maxima, present = readout.stack(group.maxima)
            usable = present & ~np.isnan(maxima)
            top = np.where(usable, maxima, -np.inf).max(axis=1)
            top[~usable.any(axis=1)] = np.nan  # nanargmax skips these layers
            layers += group.layers
            tops.append(top)
            entropy, present = readout.stack(group.entropy)
            usable = present & ~np.isnan(entropy)
            if usable.any():
                lowest.append(float(entropy[usable].min()))
        top = np.concatenate(tops) if tops else np.empty(0)
        if not np.isnan(top).all():
            out[f"{AREA}/global/{LOGIT_MAX}_layer"] = float(layers[int(np.nanargmax(top))])
        if lowest:
            out[f"{AREA}/global/{ENTROPY}_head_min"] = min(lowest)
        return out

    def close(self) -> None:
        self.plans.clear()


class _HeadGroup(NamedTuple):
    """The attention layers of every rank with one head count, stacked at flush."""

    layers: list[int]
    maxima: tuple[str, ...]  # each layer's max-logit key
    entropy: tuple[str, ...]  # each layer's entropy key


def _head_groups(ctx: MonitorContext) -> list[_HeadGroup]:
    """Derive's tables over the allocated union of layers: pipeline stages hold other
    layers, and rank 0 derives for all of them."""
    maxima = ctx.metrics.layer_specs(AREA, LOGIT_MAX)
    entropy = ctx.metrics.layer_specs(AREA, ENTROPY)
    by_width: dict[int, list[int]] = {}
    for layer, spec in maxima.items():
        by_width.setdefault(spec.size, []).append(layer)
    return [
        _HeadGroup(
            layers,
            tuple(maxima[layer].key for layer in layers),
            tuple(entropy[layer].key for layer in layers),
        )
        for layers in by_width.values()
    ]


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the model's attention multiplied q and k in: the autocast dtype for
    float32 q/k under autocast (SDPA is on autocast's lower-precision list), else theirs.
    Host state only."""
    device_type = q.device.type
    if q.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if dtype in (torch.bfloat16, torch.float16):
            return dtype
    return q.dtype


def _check_site(site: AttentionSite) -> None:
    """Static facts the hot path relies on, checked once at registration."""
    if site.n_kv_heads < 1 or site.n_heads % site.n_kv_heads:
        raise UsageError(
            f"attention monitor: layer {site.layer} has {site.n_heads} query heads and "
            f"{site.n_kv_heads} kv heads; grouped-query attention needs n_heads to be a "
            "multiple of n_kv_heads (check the adapter's AttentionSite)"
        )
    if site.sliding_window is not None and (not site.causal or site.sliding_window < 1):
        raise UsageError(
            f"attention monitor: layer {site.layer} has sliding_window="
            f"{site.sliding_window} with causal={site.causal}; only a causal sliding window "
            "of at least one key is supported"
        )


class _LayerRecorder:
    """The qk callback of one layer: its slots, static shape facts and sampling phase."""

    def __init__(
        self, monitor: AttentionMonitor, site: AttentionSite, logit_max: Slot, entropy: Slot
    ) -> None:
        self.monitor = monitor
        self.layer = site.layer
        self.n_heads, self.n_kv_heads = site.n_heads, site.n_kv_heads
        self.head_dim = site.head_dim
        self.scale = float(site.scale)
        self.causal, self.window = site.causal, site.sliding_window
        # The site hands q/k before their rotation (attach_qk_rotary): the grouped
        # launch then takes (q, k, cos, sin) per layer.
        self.rotary_inputs = bool(getattr(site, "rotate_half", False))
        self.logit_max, self.entropy = logit_max, entropy  # narrowed to the rank's heads at attach
        self.frac: Slot | None = None
        self.group: SlotGroup | None = None  # the fused path's fold targets (attach)
        self.sampled_calls = 0  # rotates the sampling phase; host int, no device state
        self.compute = torch.float32  # the dtype of the last record's logits' inputs
        self._checked: tuple | None = None  # what was taken to the batch, checked once

    @hot_path
    def record(self, q: torch.Tensor, k: torch.Tensor, rotary: Rotary | None = None) -> None:
        if not self.monitor.active and not capturing(q.is_cuda):
            return
        self.compute = _compute_dtype(q)
        batch_of_layers = self.monitor._batch
        key = (q.shape, k.shape, q.dtype, rotary is None)
        if batch_of_layers is not None and key == self._checked and kernels.use_triton(q):
            # Shapes seen and checked before (every step of a fixed-shape run): the
            # grouped launch reads the tensors; holding them needs no detach.
            batch_of_layers.add(self.layer, *self._kernel_inputs(q, k, rotary))
            return
        self._check_shapes(q, k)
        batch, _, q_len, _ = q.shape
        k_len = k.shape[2]
        seen = batch * q_len  # query rows per head: the mean's count, from shapes only
        if kernels.use_triton(q) and kernels.qk_supported(q, k):
            # The kernel masks from indices: it needs the stride, never a plan's masks.
            check_lengths(q_len, k_len, self.causal)
            inputs = self._kernel_inputs(q, k, rotary)
            if batch_of_layers is not None and (rotary is not None) == self.rotary_inputs:
                self._checked = key
                batch_of_layers.add(self.layer, *inputs)
                return
            self.record_fused(*inputs)
            return
        if rotary is not None:
            q, k = rotary.rotated(q, k)
        if self.compute != q.dtype:  # what SDPA multiplied under autocast
            q, k = q.to(self.compute), k.to(self.compute)
        plan = self.monitor.plans.get(
            batch, self.n_heads, q_len, k_len, self.causal, self.window, q.device
        )
        device_type = q.device.type
        if torch.is_autocast_enabled(device_type):
            # float32 statistics even when the forward runs under bf16/fp16 autocast.
            with torch.autocast(device_type, enabled=False):
                qk_max, entropy_sum, used = self._measure(q, k, plan)
        else:  # skip the context manager (a few microseconds of host time) when off
            qk_max, entropy_sum, used = self._measure(q, k, plan)
        self.logit_max.update(qk_max)
        self.entropy.add(entropy_sum, count=seen)
        assert self.frac is not None, "attach() sets the sampled-fraction slot"
        self.frac.add(used, count=seen)

    @property
    def statics(self) -> tuple:
        """What one grouped kernel needs every layer to share."""
        return (self.n_heads, self.n_kv_heads, self.head_dim, self.scale, self.causal,
                self.window, self.rotary_inputs)  # fmt: skip

    @hot_path
    def _kernel_inputs(
        self, q: torch.Tensor, k: torch.Tensor, rotary: Rotary | None
    ) -> tuple[torch.Tensor, ...]:
        """What the kernel reads: (q, k), or (q, k rotated, cos, sin) for unrotated q/k
        (k rotated by one launch, straight into the compute dtype)."""
        if rotary is None:
            return q, k
        cos, sin = rotary.cos, rotary.sin
        assert self.group is not None, "attach() builds the fold group"
        k = kernels.rope_rotate(k, cos, sin, self.compute, self.group.kernel_gate)
        return q, k, cos, sin

    @hot_path
    def record_fused(self, q: torch.Tensor, k: torch.Tensor, *rope: torch.Tensor) -> None:
        """This layer alone through the fused kernel (sampled rows at a rotating phase
        when the logits would not fit ``max_elements``); ``rope``: q's cos and sin."""
        batch, _, q_len, _ = q.shape
        budget = self.monitor.fused_max_elements
        stride = row_stride(batch, self.n_heads, q_len, k.shape[2], budget)
        phase = self._next_phase(stride)
        assert self.group is not None, "attach() builds the fold group"
        partials = kernels.qk_stats_partials(
            q, k, self.scale, self.causal, self.window, phase, stride, stride,
            q_rope=tuple(rope) or None, compute_dtype=self.compute,  # type: ignore[arg-type]
            gate=self.group.kernel_gate,
        )  # fmt: skip
        self.group.fold(partials, batch * q_len)

    @hot_path
    def _measure(
        self, q: torch.Tensor, k: torch.Tensor, plan: RowPlan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-head max logit, per-head entropy sum scaled to all rows, rows used)."""
        stride = plan.stride
        if stride == 1:
            qk_max, entropy_sum = qk_stats(q, k, self.scale, plan.mask)
            return qk_max, entropy_sum, plan.used_rows[0]
        # Phase r uses queries r, r + stride, ...: stride consecutive calls of one shape
        # use every row once, and over the phase each row is used with probability
        # 1/stride, so scaling the sum by stride (Horvitz-Thompson) makes it an unbiased
        # estimate of the sum over all rows.
        if torch.compiler.is_compiling():
            return measure_sampled_traced(q, k, self.scale, plan)
        phase = self._next_phase(stride)
        rows = q[:, :, phase::stride]  # a view: the offset is a host int
        n_rows = rows.shape[2]
        qk_max, entropy_sum = qk_stats(rows, k, self.scale, plan.sampled_mask(phase, n_rows))
        return qk_max, entropy_sum * stride, plan.used_rows[plan.rows - n_rows]

    def _next_phase(self, stride: int) -> int:
        if stride == 1:
            return 0
        phase = self.sampled_calls % stride
        self.sampled_calls += 1
        return phase

    def _check_shapes(self, q: torch.Tensor, k: torch.Tensor) -> None:
        # Shapes are host metadata: checking them reads nothing from the device.
        if (
            q.dim() != 4
            or k.dim() != 4
            or q.shape[1] != self.n_heads
            or k.shape[1] != self.n_kv_heads
            or q.shape[3] != self.head_dim
            or k.shape[3] != self.head_dim
            or k.shape[0] != q.shape[0]
        ):
            raise ValueError(
                f"attention monitor, layer {self.layer}: expected q [B, {self.n_heads}, L, "
                f"{self.head_dim}] and k [B, {self.n_kv_heads}, S, {self.head_dim}], got "
                f"q {list(q.shape)} and k {list(k.shape)}; the adapter's AttentionSite "
                "does not match the module"
            )
