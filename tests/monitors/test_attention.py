"""AttentionMonitor against a naive per-(batch, head, query) reference.

The reference loops in Python over batch, head and query row, builds each row's allowed
keys explicitly, and computes the logits, their max and the softmax entropy in float64
with ``.item()``/``.tolist()``: nothing is shared with the monitor's batched kernels.
Every hook runs under ``no_sync(cpu_as_device=True)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from torch import nn

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.metrics import MetricSet, Readout
from syncless.monitors import attach, build
from syncless.monitors.adapters import AttentionSite, LayerSite, ModelMap, find_layers
from syncless.monitors.attention import AttentionMonitor
from syncless.monitors.attention_stats import PlanCache, row_stride, rows_at_phase
from syncless.monitors.base import MonitorContext
from syncless.testing import spawn_gloo

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


def monitored(sites, **kwargs) -> tuple[AttentionMonitor, MetricSet]:
    layers = [LayerSite(s.layer, nn.Identity(), s, None, None) for s in sites]
    ctx = MonitorContext(ModelMap("fake", layers, d_model=32), MetricSet())
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


# -- exact mode ---------------------------------------------------------------------

SHAPES = [
    # batch, heads, kv_heads, q_len, k_len, causal, window
    pytest.param(2, 4, 4, 7, 7, True, None, id="mha-causal"),
    pytest.param(2, 6, 2, 9, 9, True, None, id="gqa-causal"),
    pytest.param(3, 4, 1, 5, 11, False, None, id="mqa-cross"),
    pytest.param(1, 2, 2, 4, 10, True, None, id="causal-kv-cache"),
    pytest.param(2, 4, 2, 12, 12, True, 3, id="gqa-sliding-window"),
    pytest.param(1, 3, 3, 1, 1, True, None, id="one-token"),
]


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "q_len", "k_len", "causal", "window"), SHAPES
)
def test_exact_statistics_match_the_naive_reference(
    batch, heads, kv_heads, q_len, k_len, causal, window, kernel_backend
):
    site = fake_site(heads=heads, kv_heads=kv_heads, causal=causal, window=window)
    mon, ms = monitored([site])
    q, k = qk(batch, heads, kv_heads, q_len, k_len, seed=q_len)
    site.fire(q, k)
    check(flush(ms), naive(q, k, site.scale, causal, window), frac=1.0)
    assert mon.plans.builds == (1 if kernel_backend == "torch" else 0)  # the kernel needs none


def test_low_precision_inputs_and_autocast_are_computed_in_float32():
    site = fake_site(heads=4, kv_heads=2)
    _, ms = monitored([site])
    q, k = qk(2, 4, 2, 16, spread=6.0)
    q, k = q.bfloat16(), k.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        site.fire(q, k)
    # The reference sees the same bf16 values, in float64: a bf16 matmul/softmax would
    # miss by ~1e-2, the float32 path agrees to ~1e-6.
    check(flush(ms), naive(q.float(), k.float(), site.scale, True))


def test_float32_qk_under_autocast_are_rounded_as_sdpa_sees_them(kernel_backend):
    """HF under bf16 autocast hands float32 q/k (float32 cos/sin) and SDPA casts them
    to bf16: the logits are those of the bf16 values (the float32 ones differ)."""
    site = fake_site(heads=4, kv_heads=2)
    _, ms = monitored([site])
    q, k = qk(2, 4, 2, 16, spread=6.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        site.fire(q, k)
    readout = flush(ms)
    check(readout, naive(q.bfloat16().float(), k.bfloat16().float(), site.scale, True))
    exact = naive(q, k, site.scale, True).maxes
    assert not np.allclose(readout.get(MAX.format(0)), exact, rtol=1e-6)


def test_two_calls_accumulate_max_and_count_weighted_mean():
    site = fake_site(heads=2, kv_heads=1)
    _, ms = monitored([site])
    small, large = qk(1, 2, 1, 5, seed=1, spread=0.5), qk(3, 2, 1, 9, seed=2, spread=4.0)
    site.fire(*small)
    site.fire(*large)
    ref = naive(*small, site.scale, True).merge(naive(*large, site.scale, True))
    readout = flush(ms)
    check(readout, ref, frac=1.0)
    # Not the mean of the two calls' means: 5 rows against 27 per head.
    per_call = [naive(*x, site.scale, True) for x in (small, large)]
    naive_mean = np.mean([np.array(r.entropy_sums) / r.seen for r in per_call], axis=0)
    assert np.all(np.abs(readout.get(ENT.format(0)) - naive_mean) > 1e-3)


def test_inactive_records_nothing():
    site = fake_site()
    mon, ms = monitored([site])
    mon.active = False
    site.fire(*qk(2, 4, 4, 6))
    readout = flush(ms)
    for key in (MAX.format(0), ENT.format(0), FRAC):
        assert not readout.present[key].any()
    assert mon.plans.builds == 0 and mon.derive(readout) == {}


def test_shape_mismatch_names_the_layer():
    site = fake_site(layer=3, heads=4, kv_heads=2)
    monitored([site])
    with pytest.raises(ValueError, match="layer 3: expected q \\[B, 4, L, 8\\]"):
        site.fire(*qk(1, 4, 4, 5))


def test_causal_with_more_queries_than_keys_is_refused():
    site = fake_site()
    monitored([site])
    with pytest.raises(ValueError, match="6 queries but 4 keys"):
        site.fire(*qk(1, 4, 4, 6, k_len=4))


def test_plan_cache_builds_once_per_shape_and_is_bounded():
    plans = PlanCache(2**24, capacity=2)
    cpu = torch.device("cpu")
    for q_len in (4, 5, 4, 6, 4, 5):
        plans.get(1, 2, q_len, q_len, True, None, cpu)
    # 4 (built), 5 (built), 4 (hit), 6 (built, evicts 5), 4 (hit), 5 (rebuilt, evicts 6)
    assert (plans.builds, len(plans)) == (4, 2)


def test_invalid_sites_are_rejected_at_prepare():
    from syncless.errors import UsageError

    with pytest.raises(UsageError, match="multiple of n_kv_heads"):
        monitored([fake_site(heads=6, kv_heads=4)])
    with pytest.raises(UsageError, match="causal sliding window"):
        monitored([fake_site(causal=False, window=4)])


# -- sampled mode -------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 10, 100, 1000, 4096, 10**6])
@pytest.mark.parametrize(
    ("batch", "heads", "q_len", "k_len"), [(1, 1, 1, 1), (2, 4, 37, 37), (3, 8, 100, 260)]
)
def test_row_stride_keeps_the_budget(budget, batch, heads, q_len, k_len):
    stride = row_stride(batch, heads, q_len, k_len, budget)
    used = rows_at_phase(q_len, stride, 0)
    assert 1 <= used <= q_len and used == len(range(0, q_len, stride))
    if stride == 1:
        assert batch * heads * q_len * k_len <= budget
    elif batch * heads * k_len <= budget:  # below one row per sequence it cannot hold
        assert batch * heads * used * k_len <= budget
        # and the stride is the smallest that holds it
        assert batch * heads * rows_at_phase(q_len, stride - 1, 0) * k_len > budget


@pytest.mark.parametrize(
    ("heads", "kv_heads", "q_len", "k_len", "causal", "window"),
    [
        pytest.param(4, 2, 20, 20, True, None, id="gqa-causal"),
        pytest.param(4, 4, 20, 26, False, None, id="cross"),
        pytest.param(4, 1, 20, 20, True, 5, id="mqa-window"),
    ],
)
def test_sampled_mode_matches_the_reference_on_the_sampled_rows(
    heads, kv_heads, q_len, k_len, causal, window, kernel_backend
):
    batch = 2
    # 7 rows fit: stride 3, phases 0 and 1 use 7 rows, phase 2 uses 6.
    budget = batch * heads * k_len * 7
    site = fake_site(heads=heads, kv_heads=kv_heads, causal=causal, window=window)
    mon, ms = monitored([site], max_elements=budget)
    q, k = qk(batch, heads, kv_heads, q_len, k_len, seed=5)
    exact = naive(q, k, site.scale, causal, window)
    stride = 3
    total = None
    for phase in range(stride):
        site.fire(q, k)
        rows = range(phase, q_len, stride)
        ref = naive(q, k, site.scale, causal, window, rows=rows)
        check(flush(ms), ref, scaled_by=stride, frac=len(rows) / q_len)
        # a lower bound of the exact max
        assert all(s <= e + 1e-9 for s, e in zip(ref.maxes, exact.maxes, strict=True))
        total = ref if total is None else total.merge(ref)
    assert mon.plans.builds == (1 if kernel_backend == "torch" else 0)  # the kernel needs none
    # Over one cycle of phases every row is used once: exact max, exact mean entropy.
    np.testing.assert_allclose(total.maxes, exact.maxes, rtol=1e-12)
    np.testing.assert_allclose(total.entropy_sums, exact.entropy_sums, rtol=1e-9)
    for _ in range(stride):
        site.fire(q, k)
    # 3 calls: Σ 3 * sampled / (3 * B * L) is the exact mean; each row was used once in 3
    check(flush(ms), exact, frac=1 / stride)


def test_sampled_mode_is_used_only_above_the_budget():
    q, k = qk(2, 2, 2, 8)
    elements = 2 * 2 * 8 * 8
    for budget, stride in ((elements, 1), (elements - 1, 2)):
        site = fake_site(heads=2, kv_heads=2)
        _, ms = monitored([site], max_elements=budget)
        site.fire(q, k)
        ref = naive(q, k, site.scale, True, rows=range(0, 8, stride))
        check(flush(ms), ref, scaled_by=stride, frac=1 / stride)


# -- derive -------------------------------------------------------------------------


def test_derive_names_the_layer_with_the_largest_logit():
    sites = [fake_site(layer=0), fake_site(layer=1)]
    mon, ms = monitored(sites)
    quiet, loud = qk(1, 4, 4, 6, seed=1, spread=0.1), qk(1, 4, 4, 6, seed=2, spread=10.0)
    sites[0].fire(*quiet)
    sites[1].fire(*loud)
    readout = flush(ms)
    refs = [naive(*x, sites[0].scale, True) for x in (quiet, loud)]
    derived = mon.derive(readout)
    assert derived["monitors/global/attn_qk_logit_max_layer"] == 1.0
    lowest = min(min(np.array(r.entropy_sums) / r.seen) for r in refs)
    assert derived["monitors/global/attn_entropy_nats_head_min"] == pytest.approx(lowest, rel=1e-5)
    # the metric core's global over layers
    np.testing.assert_allclose(
        readout.get("monitors/global/attn_qk_logit_max"),
        np.maximum(refs[0].maxes, refs[1].maxes),
        rtol=1e-5,
    )


# -- end to end on the demo model ----------------------------------------------------


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) at position p by p * 10000^(-2i/D), in float64."""
    *_, seq, dh = x.shape
    out = torch.empty_like(x, dtype=torch.float64)
    for p in range(seq):
        for i in range(dh // 2):
            theta = p * 10_000.0 ** (-2 * i / dh)
            c, s = math.cos(theta), math.sin(theta)
            a, b = x[..., p, 2 * i].double(), x[..., p, 2 * i + 1].double()
            out[..., p, 2 * i] = a * c - b * s
            out[..., p, 2 * i + 1] = a * s + b * c
    return out


def _demo_reference(model: MoETransformer, tokens: torch.Tensor) -> list[Ref]:
    """Per layer: q, k recomputed from the weights on the layer's input, then `naive`."""
    refs = []
    with torch.no_grad():
        x = model.embed(tokens)
        for block in model.layers:
            attn = block.attn
            h = block.attn_norm(x).double()
            b, seq, _ = h.shape

            def heads(t, attn=attn, b=b, seq=seq):
                return t.view(b, seq, attn.n_heads, attn.head_dim).transpose(1, 2)

            q = _rope(heads(h @ attn.q_proj.weight.double().T))
            k = _rope(heads(h @ attn.k_proj.weight.double().T))
            refs.append(naive(q, k, attn.head_dim**-0.5, True))
            x, _ = block(x)
    return refs


@pytest.mark.parametrize("launch", ["layer", "grouped"])
def test_demo_model_end_to_end(kernel_backend, launch):
    model = MoETransformer(preset("tiny"))
    init_weights(model, seed=0)
    with torch.no_grad():  # far from the 0.02 init so attention is far from uniform
        g = torch.Generator().manual_seed(1)
        for block in model.layers:
            for proj in (block.attn.q_proj, block.attn.k_proj):
                proj.weight.normal_(0.0, 0.3, generator=g)
    batches = [
        torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2)),
        torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(3)),
    ]
    refs = [_demo_reference(model, t) for t in batches]  # before any hook is attached
    ctx = MonitorContext(find_layers(model), MetricSet())
    mon = AttentionMonitor(launch=launch)
    mon.prepare(ctx)
    ctx.metrics.allocate("cpu")
    mon.attach(ctx)
    with no_sync(cpu_as_device=True):
        for tokens in batches:
            logits, balance = model(tokens)
            (logits.square().mean() + balance).backward()
    if launch == "grouped" and kernel_backend == "triton":
        # one grouped launch per forward: both layers' q/k in one kernel
        assert (mon._batch.grouped_launches, mon._batch.single_launches) == (2, 0)
    readout = flush(ctx.metrics)
    for layer in range(len(model.layers)):
        ref = refs[0][layer].merge(refs[1][layer])
        check(readout, ref, layer=layer, frac=1.0)
    # torch ops: one plan per shape, shared by the layers; the kernel needs none
    assert mon.plans.builds == (2 if kernel_backend == "torch" else 0)

    # Off-steps record nothing, and removing the handles detaches the monitor.
    mon.active = False
    with no_sync(cpu_as_device=True):
        model(batches[0])
    assert not flush(ctx.metrics).present[MAX.format(0)].any()
    for h in ctx.handles:
        h.remove()
    mon.active = True
    with no_sync(cpu_as_device=True):
        model(batches[0])
    assert not flush(ctx.metrics).present[MAX.format(0)].any()
    mon.close()


def test_attach_emits_per_head_and_derived_records():
    model = MoETransformer(preset("tiny"))
    init_weights(model, seed=0)
    handle = attach(model, build("attention"), lagged=False)
    with no_sync(cpu_as_device=True):
        model(torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(4)))
    records = {r.name: r.value for r in handle.step(0)}
    handle.close()
    for layer in range(len(model.layers)):
        for name in ("attn_qk_logit_max", "attn_entropy_nats"):
            assert f"monitors/layer_{layer:02d}/{name}" in records
            assert f"monitors/layer_{layer:02d}/{name}/head_3" in records
    assert records[FRAC] == 1.0
    assert "monitors/global/attn_qk_logit_max" in records
    assert records["monitors/global/attn_qk_logit_max_layer"] in (0.0, 1.0)
    # near-uniform attention at the 0.02 init: every head's entropy is below ln(8)
    assert 0.0 < records["monitors/global/attn_entropy_nats_head_min"] < math.log(8)


# -- two gloo ranks -----------------------------------------------------------------

# Unequal query counts per rank (rank 1 has 6x the rows) and different logit spreads,
# so the mean of per-rank means is far from the count-weighted mean.
RANK_BATCH, RANK_SPREAD, DIST_LEN = (1, 3), (0.3, 4.0), 8


def _rank_inputs(rank: int):
    return qk(RANK_BATCH[rank], 4, 2, 2 * DIST_LEN if rank else DIST_LEN, seed=10 + rank,
              spread=RANK_SPREAD[rank])  # fmt: skip


def _dist_worker(rank, world):
    out = []
    # exact everywhere; then a budget under which rank 1 samples (stride 2) and rank 0 not
    for budget in (2**24, 3 * 4 * 16 * 8):
        site = fake_site(heads=4, kv_heads=2)
        _, ms = monitored([site], max_elements=budget)
        site.fire(*_rank_inputs(rank))
        readout = flush(ms)
        out.append({key: readout.get(key) for key in (MAX.format(0), ENT.format(0), FRAC)})
    return out


@pytest.mark.dist
def test_two_ranks_aggregate_max_and_count_weighted_entropy():
    results = spawn_gloo(_dist_worker, 2)
    scale = 8**-0.5
    refs = [naive(*_rank_inputs(r), scale, True) for r in range(2)]
    exact = refs[0].merge(refs[1])
    # rank 1 sampled with stride 2 at phase 0: rows 0, 2, ..., its sum scaled by 2
    q1, k1 = _rank_inputs(1)
    sampled1 = naive(q1, k1, scale, True, rows=range(0, 2 * DIST_LEN, 2))
    mixed = refs[0].merge(sampled1, entropy_weight=2.0)
    for exact_values, mixed_values in results:  # every rank sees the cluster view
        np.testing.assert_allclose(exact_values[MAX.format(0)], exact.maxes, rtol=1e-5)
        weighted = np.array(exact.entropy_sums) / exact.seen
        np.testing.assert_allclose(exact_values[ENT.format(0)], weighted, rtol=1e-5)
        np.testing.assert_allclose(exact_values[FRAC], [1.0])
        per_rank_means = np.mean([np.array(r.entropy_sums) / r.seen for r in refs], axis=0)
        assert np.all(np.abs(weighted - per_rank_means) > 0.05)

        np.testing.assert_allclose(mixed_values[MAX.format(0)], mixed.maxes, rtol=1e-5)
        np.testing.assert_allclose(
            mixed_values[ENT.format(0)], np.array(mixed.entropy_sums) / mixed.seen, rtol=1e-5
        )
        used = refs[0].seen + sampled1.rows
        np.testing.assert_allclose(mixed_values[FRAC], [used / mixed.seen])


def test_grouped_launch_takes_the_per_layer_path_in_sampled_mode(kernel_backend):
    """Above the budget each layer rotates its own sampling phase: the grouped kernel
    (exact rows only) steps aside, and the values equal the per-layer launches'."""
    if kernel_backend != "triton":
        pytest.skip("the grouped path is the Triton path")
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(4))
    readouts = {}
    for launch in ("layer", "grouped"):
        model = MoETransformer(preset("tiny"))
        init_weights(model, seed=0)
        ctx = MonitorContext(find_layers(model), MetricSet())
        mon = AttentionMonitor(max_elements=64, fused_max_elements=64, launch=launch)
        mon.prepare(ctx)
        ctx.metrics.allocate("cpu")
        mon.attach(ctx)
        with no_sync(cpu_as_device=True), torch.no_grad():
            for _ in range(3):
                model(tokens)
        readouts[launch] = flush(ctx.metrics)
        if launch == "grouped":
            assert mon._batch.grouped_launches == 0
            assert mon._batch.single_launches == 3 * len(model.layers)
    for key in readouts["layer"].values:
        np.testing.assert_array_equal(
            readouts["layer"].values[key], readouts["grouped"].values[key]
        )


def test_the_fused_path_has_its_own_budget(kernel_backend):
    """The fused kernel keeps no logits: above the torch path's memory budget it is still
    exact while its own budget holds; the torch path samples."""
    q, k = qk(2, 2, 2, 8)
    elements = 2 * 2 * 8 * 8
    site = fake_site(heads=2, kv_heads=2)
    _, ms = monitored([site], max_elements=elements - 1, fused_max_elements=elements)
    site.fire(q, k)
    stride = 1 if kernel_backend == "triton" else 2
    ref = naive(q, k, site.scale, True, rows=range(0, 8, stride))
    check(flush(ms), ref, scaled_by=stride, frac=1 / stride)
