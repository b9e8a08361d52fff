"""Per layer, the first step its per-step RMS left its own recent band, on the device.

A loss spike or a NaN is the last symptom; a layer whose activations or gradients drift
is often the first. Each step (``MonitorHandle.step``, after the backward) a layer's RMS
of that step, from the growth of its mean-of-squares metric since the previous step, is
compared with an exponential moving mean and variance of its own log RMS. A value more
than ``sigmas`` standard deviations and ``min_ratio`` times away from the centre, or a
NaN/Inf, *leaves the band*: the step label goes into the layer's ``..._band_first_step``
min metric, and the band learns only from values inside it. Everything stays on the
device (syncless.kernels.bands): one launch per step on CUDA, no read-back; the
readout carries the first step each layer left since the previous readout, from which
the handle names the layer that moved first (syncless.monitors.attribution).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from syncless import kernels
from syncless.hot_path import hot_path
from syncless.metrics import MetricSet, Slot

__all__ = ["BandRule", "LayerBands"]


@dataclass(frozen=True, kw_only=True)
class BandRule:
    """When a layer's per-step RMS has left its own recent band.

    The defaults were chosen on the demo's CPU presets and tiny Hugging Face models,
    where no layer left its band in ordinary training after the warm-up, and a
    gradient scaled 4x at one layer left it at that step (docs/monitors/gradients.md).
    """

    horizon: int = 64
    """Steps the band's moving mean and variance average over (a plain running mean and
    variance until a layer has seen that many)."""
    warmup: int = 16
    """Steps a layer learns before it has a band (only NaN/Inf count as leaving before)."""
    sigmas: float = 6.0
    """How far from the centre, in standard deviations of the log RMS, is outside."""
    min_ratio: float = 1.5
    """And at least this factor away from the centre's RMS: a layer whose RMS barely
    moves has a tiny deviation that ordinary noise would cross."""

    def __post_init__(self) -> None:
        if self.horizon < 2 or self.warmup < 1 or self.sigmas <= 0 or self.min_ratio <= 1:
            raise ValueError(
                f"BandRule needs horizon >= 2, warmup >= 1, sigmas > 0 and min_ratio > 1; "
                f"got {self}"
            )


DEFAULT_BANDS = BandRule()


class LayerBands:
    """The bands of one mean-of-squares metric over layers (module doc).

    ``means``: layer -> its mean metric of the squares (``grad_out_sq``, ``act_sq``);
    ``firsts``: layer -> its ``..._band_first_step`` min metric. Both allocated.
    """

    def __init__(
        self,
        metrics: MetricSet,
        means: dict[int, Slot],
        firsts: dict[int, Slot],
        rule: BandRule | None = None,
    ) -> None:
        if metrics.buffer is None:
            raise RuntimeError("LayerBands needs an allocated MetricSet: allocate() first")
        layers = sorted(means)
        device = metrics.buffer.device
        self.rule = rule or BandRule()
        self.metrics = metrics
        self.layers = layers

        def at(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device)

        offsets = [means[i].offsets for i in layers]
        first_offsets = [firsts[i].offsets for i in layers]
        self._sum_at = at([o[0] for o in offsets])  # type: ignore[index]
        self._count_at = at([o[1] for o in offsets])  # type: ignore[index]
        self._first_at = at([o[2] for o in first_offsets])  # type: ignore[index]
        # the moving mean of the log RMS, its variance, steps learnt, and the previous
        # cumulative sum and count (the metric's, since the last flush)
        self._state = torch.zeros(5, len(layers), dtype=torch.float64, device=device)
        gate = metrics.gate_of(firsts[layers[0]].spec.key)
        self._gate = metrics.gate_views(gate)[0]
        self._fused = kernels.use_triton(metrics.buffer)

    @hot_path
    def update(self) -> None:
        """This step's RMS of every layer against its band (after the backward)."""
        rule = self.rule
        update = kernels.band_update if self._fused else band_update_torch
        update(
            self.metrics.buffer, self._sum_at, self._count_at, self._first_at, self._state,  # type: ignore[arg-type]
            self._gate, self.metrics.step_label, rule.horizon, rule.warmup, rule.sigmas,
            rule.min_ratio,
        )  # fmt: skip

    def after_flush(self) -> None:
        """A flush restarted the buffer's sums and counts: so do the previous ones."""
        self._state[3:].zero_()


@hot_path
def band_update_torch(
    buffer: torch.Tensor,
    sum_at: torch.Tensor,
    count_at: torch.Tensor,
    first_at: torch.Tensor,
    state: torch.Tensor,
    gate: torch.Tensor,
    step: torch.Tensor,
    horizon: int,
    warmup: int,
    sigmas: float,
    min_ratio: float,
) -> None:
    """``syncless.kernels.bands.band_update`` in torch ops (CPU, or no Triton)."""
    s, c = buffer[sum_at], buffer[count_at]
    mean, var, seen, prev_s, prev_c = state.unbind(0)
    d_count = c - prev_c
    ms = (s - prev_s) / d_count.clamp_min(1.0)
    prev_s.copy_(s)
    prev_c.copy_(c)
    has = (d_count > 0) & (ms != 0)
    x = 0.5 * torch.where(has, ms, 1.0).log()
    finite = x.isfinite()
    dev = x - mean
    outside = (dev.abs() > sigmas * var.sqrt()) & (dev.abs() > math.log(min_ratio))
    left = has & (~finite | ((seen >= warmup) & outside))
    first = torch.where(left & (gate != 0), -step, -torch.inf)
    buffer.scatter_reduce_(0, first_at, first, "amax")
    learn = has & finite & ~left
    a = torch.where(seen < horizon, 1.0 / (seen + 1.0), 2.0 / (horizon + 1.0))
    a = torch.where(learn, a, 0.0)
    dev = torch.where(learn, dev, 0.0)
    incr = a * dev
    mean.add_(incr)
    var.copy_((1.0 - a) * (var + dev * incr))
    seen.add_(learn.to(seen.dtype))
