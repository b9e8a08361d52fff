"""Per-step statistics kept on the device across steps: a layer's band, a value's window.

Both run once per step, from ``handle.step`` (outside any CUDA graph), one launch each
on CUDA; the torch fallbacks (syncless.monitors.bands, syncless.monitors.spikes) do the
same arithmetic in a few dozen small ops.

``band_update``: per layer, this step's RMS from the growth of a mean metric's sum and
count since the previous step (``sqrt(d_sum / d_count)``), its log compared with the
layer's exponential moving mean and variance; a layer that leaves the band (or turns
NaN/Inf) writes the current step label into its "first step" min metric. The band
learns only from values inside it.

``spike_update``: one scalar per step (the loss, the gradient norm) against the mean and
standard deviation of the last ``W`` finite values that were not spikes; a spike adds 1
to a count metric and writes the step label into a "first step" min metric.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from syncless.hot_path import hot_path


@triton.jit
def _band_kernel(
    buf_ptr, sum_at_ptr, count_at_ptr, first_at_ptr, state_ptr, gate_ptr, step_ptr, L,
    horizon, warmup, sigmas, log_min_ratio, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, BLOCK)
    ok = i < L
    s = tl.load(buf_ptr + tl.load(sum_at_ptr + i, mask=ok, other=0), mask=ok, other=0.0)
    c = tl.load(buf_ptr + tl.load(count_at_ptr + i, mask=ok, other=0), mask=ok, other=0.0)
    mean = tl.load(state_ptr + i, mask=ok, other=0.0)
    var = tl.load(state_ptr + L + i, mask=ok, other=0.0)
    seen = tl.load(state_ptr + 2 * L + i, mask=ok, other=0.0)
    prev_s = tl.load(state_ptr + 3 * L + i, mask=ok, other=0.0)
    prev_c = tl.load(state_ptr + 4 * L + i, mask=ok, other=0.0)
    tl.store(state_ptr + 3 * L + i, s, mask=ok)
    tl.store(state_ptr + 4 * L + i, c, mask=ok)
    d_count = c - prev_c
    ms = (s - prev_s) / tl.maximum(d_count, 1.0)
    has = ok & (d_count > 0) & (ms != 0.0)  # a zero RMS (a frozen layer) says nothing
    x = 0.5 * tl.log(tl.where(has, ms, 1.0))
    bad = (x != x) | (tl.abs(x) == float("inf"))
    dev = x - mean
    spread = tl.abs(dev)
    outside = (spread > sigmas * tl.sqrt(var)) & (spread > log_min_ratio)
    # NaN/Inf leaves at once; a finite value only once the layer has a band
    left = has & (bad | ((seen >= warmup) & outside))
    gate = tl.load(gate_ptr)
    first_at = tl.load(first_at_ptr + i, mask=ok, other=0)
    neg_step = -tl.load(step_ptr)
    write = tl.where(gate != 0.0, left, False)
    old = tl.load(buf_ptr + first_at, mask=write, other=0.0)
    tl.store(buf_ptr + first_at, tl.maximum(old, neg_step), mask=write)
    learn = tl.where(left | bad, False, has)
    a = tl.where(seen < horizon, 1.0 / (seen + 1.0), 2.0 / (horizon + 1.0))
    a = tl.where(learn, a, 0.0)
    incr = a * tl.where(learn, dev, 0.0)
    tl.store(state_ptr + i, mean + incr, mask=ok)
    tl.store(state_ptr + L + i, (1.0 - a) * (var + tl.where(learn, dev, 0.0) * incr), mask=ok)
    tl.store(state_ptr + 2 * L + i, seen + learn.to(tl.float64), mask=ok)


@hot_path
def band_update(
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
    """One step of every layer's band (module doc). ``state``: ``[5, L]`` float64: the
    moving mean of the log RMS, its variance, the steps learnt, the previous cumulative
    sum and count (zeros at first); ``*_at``: int64 buffer indices."""
    n = sum_at.numel()
    _band_kernel[(1,)](
        buffer, sum_at, count_at, first_at, state, gate, step, n, float(horizon),
        float(warmup), float(sigmas), math.log(min_ratio),
        BLOCK=max(16, triton.next_power_of_2(n)),
    )  # fmt: skip


@triton.jit
def _spike_kernel(
    value_ptr, buf_ptr, sum_at, count_at, first_at, ring_ptr, state_ptr, gate_ptr, step_ptr, W,
    warmup, sigmas, min_rel, BLOCK: tl.constexpr,
):  # fmt: skip
    x = tl.load(value_ptr).to(tl.float64)
    n = tl.load(state_ptr)  # finite non-spike values pushed so far
    head = tl.load(state_ptr + 1)
    i = tl.arange(0, BLOCK)
    held = tl.minimum(n, W)
    inside = i < held
    ring = tl.load(ring_ptr + i, mask=inside, other=0.0)
    cnt = tl.maximum(held, 1.0)
    mean = tl.sum(ring, axis=0) / cnt
    var = tl.sum(tl.where(inside, (ring - mean) * (ring - mean), 0.0), axis=0) / cnt
    finite = (x == x) & (tl.abs(x) != float("inf"))
    spike = finite & (held >= warmup) & (x > mean + sigmas * tl.sqrt(var))
    spike = spike & (x > mean + min_rel * tl.abs(mean))
    if tl.load(gate_ptr) != 0.0:
        tl.store(buf_ptr + sum_at, tl.load(buf_ptr + sum_at) + spike.to(tl.float64))
        tl.store(buf_ptr + count_at, tl.load(buf_ptr + count_at) + 1.0)
        neg_step = tl.where(spike, -tl.load(step_ptr), float("-inf"))
        tl.store(buf_ptr + first_at, tl.maximum(tl.load(buf_ptr + first_at), neg_step))
    push = finite & (spike == 0)
    slot = head.to(tl.int32)
    tl.store(ring_ptr + slot, x, mask=push)
    tl.store(state_ptr, n + push.to(tl.float64))
    tl.store(state_ptr + 1, tl.where(push, (head + 1.0) % W, head))


@hot_path
def spike_update(
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
    """One value's spike check (module doc): ``ring`` ``[W]`` float64, ``state`` ``[2]``
    float64 (values pushed, the ring's head); ``sum_at``/``count_at``: the buffer
    indices of the spike count's sum and count; ``first_at``: the first-step min
    metric's (stored negated)."""
    w = ring.numel()
    _spike_kernel[(1,)](
        value, buffer, sum_at, count_at, first_at, ring, state, gate, step, w, float(warmup),
        float(sigmas), float(min_rel), BLOCK=max(16, triton.next_power_of_2(w)),
    )  # fmt: skip
