"""What the attention monitor tests share: a naive reference, and a monitor on fake sites.

The reference loops in Python over batch, head and query row, builds each row's allowed
keys explicitly, and computes the logits, their max and the softmax entropy in float64
with ``.item()``/``.tolist()``: nothing is shared with the monitor's batched kernels.
A fake site's "forward" is calling ``fire(q, k)`` by hand, and every hook runs under
``no_sync(cpu_as_device=True)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from syncless.guard import no_sync
from syncless.metrics import MetricSet, Readout
from syncless.monitors.adapters import AttentionSite, LayerSite, ModelMap
from syncless.monitors.attention import AttentionMonitor
from syncless.monitors.base import MonitorContext
from syncless.monitors.failures import Failures

MAX = "monitors/layer_{:02d}/attn_qk_logit_max"
ENT = "monitors/layer_{:02d}/attn_entropy_nats"
FRAC = "monitors/step/attn_sampled_frac"


# -- the naive reference -------------------------------------------------------------


@dataclass
class Ref:
    """Per head: max logit over the rows used, sum of their row entropies; rows per head."""

    maxes: list[float]
    entropy_sums: list[float]
    rows: int = 0
    seen: int = 0  # rows per head of the inputs, used or not

    def merge(self, other: Ref, entropy_weight: float = 1.0) -> Ref:
        return Ref(
            [max(a, b) for a, b in zip(self.maxes, other.maxes, strict=True)],
            [a + entropy_weight * b for a, b in zip(self.entropy_sums, other.entropy_sums, strict=True)],
            self.rows + other.rows,
            self.seen + other.seen,
        )  # fmt: skip


def naive(q, k, scale, causal, window=None, rows=None) -> Ref:
    """Loop over batch, query head and query row; ``rows`` restricts the query rows."""
    b_, h_, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group = h_ // hkv
    rows = list(range(lq)) if rows is None else list(rows)
    maxes, sums = [-math.inf] * h_, [0.0] * h_
    for b in range(b_):
        for h in range(h_):
            kv = h // group
            for i in rows:
                pos = i + lk - lq  # causal alignment: the last query sees every key
                keys = [
                    j
                    for j in range(lk)
                    if not causal or (j <= pos and (window is None or pos - j < window))
                ]
                qi = q[b, h, i].double()
                logits = [(qi @ k[b, kv, j].double()).item() * scale for j in keys]
                top = max(logits)
                maxes[h] = max(maxes[h], top)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                sums[h] -= sum(w / total * math.log(w / total) for w in weights if w > 0)
    return Ref(maxes, sums, b_ * len(rows), b_ * lq)


# -- a monitor on hand-made attention sites -------------------------------------------


@dataclass
class FakeSite(AttentionSite):
    """An attention site whose forward is calling ``fire(q, k)`` by hand."""

    callbacks: list = field(default_factory=list)

    def attach_qk(self, callback):
        self.callbacks.append(callback)
        return []

    def fire(self, q, k):
        with no_sync(cpu_as_device=True):
            for cb in self.callbacks:
                cb(q, k)


def fake_site(layer=0, heads=4, kv_heads=4, head_dim=8, causal=True, window=None) -> FakeSite:
    return FakeSite(
        layer=layer,
        module=nn.Identity(),
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        scale=head_dim**-0.5,
        causal=causal,
        sliding_window=window,
    )


def monitored(sites, strict=True, **kwargs) -> tuple[AttentionMonitor, MetricSet]:
    """An attention monitor on fake sites; ``strict``: a hook's failure raises (as
    ``attach(strict=True)``), so a test sees it."""
    layers = [LayerSite(s.layer, nn.Identity(), s, None, None) for s in sites]
    failures = Failures(strict=strict)
    ctx = MonitorContext(ModelMap("fake", layers, d_model=32), MetricSet(), failures=failures)
    if "max_elements" in kwargs:  # one budget for both paths, so both sample alike
        kwargs.setdefault("fused_max_elements", kwargs["max_elements"])
    mon = AttentionMonitor(**kwargs)
    mon.prepare(ctx)
    ctx.metrics.allocate("cpu")
    mon.attach(ctx)
    return mon, ctx.metrics


def qk(batch, heads, kv_heads, q_len, k_len=None, head_dim=8, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, head_dim, generator=g) * spread
    k = torch.randn(batch, kv_heads, k_len or q_len, head_dim, generator=g)
    return q, k


def flush(ms: MetricSet) -> Readout:
    (readout,) = ms.flush(0, wait=True)
    return readout


def check(readout: Readout, ref: Ref, layer=0, *, scaled_by=1, frac=None):
    np.testing.assert_allclose(readout.get(MAX.format(layer)), ref.maxes, rtol=1e-5, atol=1e-5)
    mean = np.array(ref.entropy_sums) * scaled_by / ref.seen
    np.testing.assert_allclose(readout.get(ENT.format(layer)), mean, rtol=1e-5, atol=1e-6)
    if frac is not None:
        np.testing.assert_allclose(readout.get(FRAC), [frac], rtol=1e-12)
