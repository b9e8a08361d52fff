"""AttentionMonitor as a monitor: its hooks, its checks, its derived records.

Off-steps record nothing, bad shapes are refused (naming the layer) and bad sites at
``prepare``, plans are cached, ``derive`` names the loudest layer, and on the demo
model the hooks give the naive reference's values (q and k recomputed from the
weights), end to end and through ``attach``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from attention_helpers import (  # tests/monitors is on sys.path (no __init__.py)
    ENT,
    FRAC,
    MAX,
    Ref,
    check,
    fake_site,
    flush,
    monitored,
    naive,
    qk,
)

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.metrics import MetricSet
from syncless.monitors import attach, build
from syncless.monitors.adapters import find_layers
from syncless.monitors.attention import AttentionMonitor
from syncless.monitors.attention_stats import PlanCache
from syncless.monitors.base import MonitorContext

# -- switching off, refusing bad inputs, caching plans -------------------------------


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


def test_a_bad_shape_without_strict_is_counted_and_reported_once(capsys):
    site = fake_site(layer=3, heads=4, kv_heads=2)
    mon, ms = monitored([site], strict=False)
    for _ in range(3):
        site.fire(*qk(1, 4, 4, 5))  # the forward goes on
    assert mon.active and not flush(ms).present[MAX.format(3)].any()
    err = capsys.readouterr().err
    assert err.count("attention hook failed") == 1 and "layer 3: expected q" in err


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
