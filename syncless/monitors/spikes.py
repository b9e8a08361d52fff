"""Spike alarms on the loss and the total gradient norm, checked on the device every step.

Peers pay host syncs for theirs: Megatron-LM's ``--check-for-spiky-loss`` compares each
loss with 10x the largest of the first 100 through ``.item()``; OLMo-core's stability
monitor flags a value above mean + 6 sigma of the last 128. Here the value that
``handle.step(loss=, grad_norm=)`` is given stays on the device: one launch per value
and step (syncless.kernels.bands) compares it with the mean and standard deviation of
the last ``window`` finite values that were not spikes, kept in a device ring, counts a
spike into ``monitors/step/<value>_spike_count`` and writes the step label into
``monitors/step/<value>_spike_first_step``. The readout follows the budget, the check
never sleeps, as the nonfinite alarm's (syncless.monitors.alarm acts on both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from syncless import kernels
from syncless.hot_path import hot_path
from syncless.metrics import MetricSet, Slot

__all__ = ["DEFAULT_SPIKES", "SpikeRule", "ValueSpikes"]


@dataclass(frozen=True, kw_only=True)
class SpikeRule:
    """When a loss or gradient norm is a spike: above the mean of the last ``window``
    finite non-spike values by more than ``sigmas`` standard deviations and by more than
    ``min_rel`` of the mean, once ``warmup`` values are in (docs/monitors/alarms.md says
    how each default was chosen and what it missed and caught)."""

    window: int = 128
    """Values the mean and deviation are taken over (OLMo-core's 128)."""
    warmup: int = 32
    """Values before the first check: an early loss curve falls too fast to judge."""
    sigmas: float = 6.0
    """Standard deviations above the mean (OLMo-core's 6)."""
    min_rel: float = 0.2
    """And at least this fraction of the mean above it: a flat window has a deviation so
    small that noise of a few percent would cross 6 of it."""

    def __post_init__(self) -> None:
        if self.window < 2 or not 1 <= self.warmup <= self.window:
            raise ValueError(f"SpikeRule needs window >= 2 and 1 <= warmup <= window; got {self}")
        if self.sigmas <= 0 or self.min_rel < 0:
            raise ValueError(f"SpikeRule needs sigmas > 0 and min_rel >= 0; got {self}")


#: The rule for each value: a gradient norm is noisier than a loss. On ordinary CPU runs
#: of a tiny Llama with 2 x 8 tokens a step, the gradient norm jumped to 4.15x the mean of
#: the last 128 values (17 standard deviations) with nothing wrong, the loss never more
#: than 6% (bench/RESULTS.md, spike_rules): the gradient norm's rule asks for 5x.
DEFAULT_SPIKES = {"loss": SpikeRule(), "grad_norm": SpikeRule(min_rel=4.0)}


class ValueSpikes:
    """The spike check of one value (``"loss"``, ``"grad_norm"``): its ring on the device
    and its two metrics, the count (a sum) and the first step (a min)."""

    def __init__(self, metrics: MetricSet, count: Slot, first: Slot, rule: SpikeRule) -> None:
        assert metrics.buffer is not None, "allocate() first"
        device = metrics.buffer.device
        self.rule = rule
        self.metrics = metrics
        self._ring = torch.zeros(rule.window, dtype=torch.float64, device=device)
        self._state = torch.zeros(2, dtype=torch.float64, device=device)  # pushed, head
        sum_at, count_at, _ = count.offsets  # type: ignore[misc]
        self._at = (sum_at, count_at, first.offsets[2])  # type: ignore[index]
        self._gate = metrics.gate_views(metrics.gate_of(count.spec.key))[0]
        self._fused = kernels.use_triton(metrics.buffer)

    @hot_path
    def update(self, value: torch.Tensor) -> None:
        """Check ``value`` (a device scalar of this step) and keep it if it is no spike."""
        rule = self.rule
        update = kernels.spike_update if self._fused else spike_update_torch
        update(
            value.detach(), self.metrics.buffer, *self._at, self._ring, self._state,
            self._gate, self.metrics.step_label, rule.warmup, rule.sigmas, rule.min_rel,
        )  # fmt: skip


@hot_path
def spike_update_torch(
    value: torch.Tensor,
    buffer: torch.Tensor,
    sum_at: int,
    count_at: int,
    first_at: int,
    ring: torch.Tensor,
    state: torch.Tensor,
    gate: torch.Tensor,
    step: torch.Tensor,
    warmup: int,
    sigmas: float,
    min_rel: float,
) -> None:
    """``syncless.kernels.bands.spike_update`` in torch ops (CPU, or no Triton)."""
    w = ring.numel()
    x = value.detach().to(torch.float64).reshape(())
    n, head = state[0], state[1]
    held = n.clamp(max=w)
    inside = torch.arange(w, device=ring.device) < held
    cnt = held.clamp(min=1.0)
    mean = torch.where(inside, ring, 0.0).sum() / cnt
    var = torch.where(inside, (ring - mean) ** 2, 0.0).sum() / cnt
    finite = x.isfinite()
    spike = finite & (held >= warmup) & (x > mean + sigmas * var.sqrt())
    spike = spike & (x > mean + min_rel * mean.abs())
    on = (gate != 0).to(x.dtype)
    buffer[sum_at : sum_at + 1].add_(spike.to(x.dtype) * on)
    buffer[count_at : count_at + 1].add_(on)
    first = torch.where(spike & (gate != 0), -step, -torch.inf)
    buffer[first_at : first_at + 1].clamp_(min=first)
    push = finite & ~spike
    slot = (torch.arange(w, device=ring.device) == head) & push  # no index from a value
    ring.copy_(torch.where(slot, x, ring))
    state.copy_(torch.stack([n + push.to(n.dtype), torch.where(push, (head + 1) % w, head)]))
