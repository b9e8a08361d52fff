"""MoEMonitor against naive references: router statistics, load balance, dead experts,
end to end on the demo model, and 2 gloo ranks with unequal token counts."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.metrics import MetricSet
from syncless.monitors.adapters import LayerSite, ModelMap, RouterSite, find_layers
from syncless.monitors.base import MonitorContext
from syncless.monitors.moe import MoEMonitor, load_stats, router_stats
from syncless.testing import spawn_gloo

# -- naive references (plain Python, float64) ----------------------------------------


def naive_router(rows, top_k, score):
    """Token by token: (counts per expert, mean z-loss, mean top-k score share)."""
    n_experts = len(rows[0])
    counts, zloss, mass = [0] * n_experts, 0.0, 0.0
    for row in rows:
        m = max(row)
        lse = m + math.log(sum(math.exp(v - m) for v in row))
        zloss += lse * lse
        if score == "softmax":
            s = [math.exp(v - lse) for v in row]
        else:
            s = [1.0 / (1.0 + math.exp(-v)) for v in row]
        chosen = sorted(range(n_experts), key=lambda e: -s[e])[:top_k]
        for e in chosen:
            counts[e] += 1
        mass += sum(s[e] for e in chosen) / sum(s)
    return counts, zloss / len(rows), mass / len(rows)


def naive_load(counts):
    """(max/mean, std/mean, entropy / log n) by hand."""
    n = len(counts)
    total = sum(counts)
    mean = total / n
    std = math.sqrt(sum((c - mean) ** 2 for c in counts) / n)
    entropy = -sum(c / total * math.log(c / total) for c in counts if c > 0)
    return max(counts) / mean, std / mean, entropy / math.log(n)


def naive_dead(history, window):
    """Experts with no token in any of the last ``window`` steps."""
    recent = history[-window:]
    return sum(1 for e in range(len(recent[0])) if all(step[e] == 0 for step in recent))


# -- statistics ------------------------------------------------------------------------


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_stats_match_a_naive_reference(score, dtype):
    g = torch.Generator().manual_seed(1)
    for n_tokens, n_experts, top_k in [(37, 8, 2), (5, 16, 4), (64, 4, 1), (1, 6, 6)]:
        # Distinct values per row (a permutation of half-integers, exact in bf16), so
        # the top-k choice has no ties, plus fp32 noise where the dtype can hold it.
        ranks = torch.stack([torch.randperm(n_experts, generator=g) for _ in range(n_tokens)])
        logits = ranks * 0.5 - n_experts / 4
        if dtype == torch.float32:
            logits = logits + torch.rand(n_tokens, n_experts, generator=g) * 0.4
        logits = logits.to(dtype)
        one = torch.ones((), dtype=torch.float64)
        with no_sync(cpu_as_device=True):
            stats = router_stats(logits, top_k, score, one)
        rows = [[float(v) for v in row] for row in logits.float()]
        counts, zloss, mass = naive_router(rows, top_k, score)
        np.testing.assert_array_equal(stats.counts.numpy(), counts)
        assert stats.zloss_sum.item() / n_tokens == pytest.approx(zloss, rel=1e-5)
        assert stats.mass_sum.item() / n_tokens == pytest.approx(mass, rel=1e-5)


def test_load_stats_match_a_naive_reference():
    rng = np.random.default_rng(2)
    for n in (2, 3, 8, 64):
        counts = rng.integers(0, 50, size=n).astype(np.float64)
        counts[0] += 1  # never all zero
        got = load_stats(counts)
        want = naive_load([float(c) for c in counts])
        assert got == pytest.approx(want, rel=1e-12)
    balanced = load_stats(np.full(8, 5.0))
    assert balanced == pytest.approx((1.0, 0.0, 1.0))
    one_expert = load_stats(np.array([0.0, 9.0, 0.0, 0.0]))
    assert one_expert == pytest.approx((4.0, math.sqrt(3.0), 0.0))


# -- a controllable router: logits fed straight through nn.Identity --------------------


def _identity_router(n_experts, top_k, score="softmax", layers=(0,)):
    gates, sites = [], []
    for layer in layers:
        gate = nn.Identity()
        router = RouterSite(layer, gate, n_experts, top_k, score, normalize_topk=True)
        sites.append(LayerSite(layer, gate, attention=None, router=router, mlp=None))
        gates.append(gate)
    return gates, ModelMap("test", sites, d_model=n_experts)


def _monitored(model_map, **kwargs):
    mon = MoEMonitor(**kwargs)
    ctx = MonitorContext(model_map, MetricSet())
    mon.prepare(ctx)
    ctx.metrics.allocate("cpu")
    mon.attach(ctx)
    return mon, ctx


def _choose(experts, n_experts):
    """Logits that route token t to ``experts[t]`` with top-1."""
    logits = torch.zeros(len(experts), n_experts)
    logits[torch.arange(len(experts)), torch.tensor(experts)] = 10.0
    return logits


def test_dead_experts_over_a_window():
    (gate,), model_map = _identity_router(4, 1)
    mon, ctx = _monitored(model_map, dead_window=3)
    everyone, no_three = [0, 1, 2, 3, 1], [0, 1, 2, 2, 0]
    steps = [everyone, no_three, no_three, no_three, no_three, everyone]
    history, seen = [], []
    for step, experts in enumerate(steps):
        with no_sync(cpu_as_device=True):
            gate(_choose(experts, 4))
        (readout,) = ctx.metrics.flush(step, wait=True)
        out = mon.derive(readout)
        history.append([experts.count(e) for e in range(4)])
        seen.append(out["monitors/layer_00/moe_dead_experts_count"])
        assert out["monitors/layer_00/moe_dead_experts_count"] == naive_dead(history, 3)
        assert out["monitors/global/moe_dead_window_steps_count"] == min(step + 1, 3)
    # expert 3 idles from step 1: dead once the 3-step window holds only idle steps
    assert seen == [0, 0, 0, 1, 1, 0]

    # An inactive step records nothing, derives nothing and does not enter the window.
    mon.active = False
    with no_sync(cpu_as_device=True):
        gate(_choose(no_three, 4))
    (readout,) = ctx.metrics.flush(len(steps), wait=True)
    assert mon.derive(readout) == {}
    mon.active = True
    with no_sync(cpu_as_device=True):
        gate(_choose(no_three, 4))
    (readout,) = ctx.metrics.flush(len(steps) + 1, wait=True)
    # window: steps 4, 5, 7 (6 was inactive): expert 3 had a token at step 5
    assert mon.derive(readout)["monitors/layer_00/moe_dead_experts_count"] == 0


def test_dead_window_must_be_positive():
    with pytest.raises(ValueError, match="dead_window"):
        MoEMonitor(dead_window=0)


def test_unknown_score_function_is_refused_at_prepare():
    _, model_map = _identity_router(4, 2, score="softmax_with_bias")
    with pytest.raises(ValueError, match="softmax_with_bias"):
        MoEMonitor().prepare(MonitorContext(model_map, MetricSet()))


# -- end to end on the demo model ------------------------------------------------------


def _demo(seed=0):
    torch.manual_seed(seed)
    model = MoETransformer(preset("tiny"))
    init_weights(model, seed)
    return model


@torch.no_grad()
def _router_logits(model, tokens):
    """Ground truth: each layer's router logits recomputed from the gate's weights."""
    out = []
    x = model.embed(tokens)
    for block in model.layers:
        x = x + block.attn(block.attn_norm(x))
        h = block.moe_norm(x)
        flat = h.reshape(-1, h.shape[-1]).double()
        out.append(flat @ block.moe.router.gate.weight.double().t())
        y, _ = block.moe(h)
        x = x + y
    return out


@pytest.mark.parametrize("launch", ["layer", "grouped"])
def test_demo_model_end_to_end(launch, kernel_backend):
    model = _demo()
    cfg = preset("tiny")
    mon, ctx = _monitored(find_layers(model), launch=launch)
    batches = [torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (3, 10))]
    with no_sync(cpu_as_device=True):
        for tokens in batches:
            logits, balance = model(tokens)
            (logits.square().mean() + balance).backward()
        for batch in ctx.batches:  # what MonitorHandle.step does before its flush
            batch.launch()
    if launch == "grouped" and kernel_backend == "triton":
        # one grouped launch per forward, each batch a different token count
        assert (mon._batch.grouped_launches, mon._batch.single_launches) == (2, 0)
    (readout,) = ctx.metrics.flush(0, wait=True)
    out = mon.derive(readout)
    for h in ctx.handles:
        h.remove()

    per_layer = [[] for _ in model.layers]
    for tokens in batches:
        for i, layer_logits in enumerate(_router_logits(model, tokens)):
            per_layer[i] += [[float(v) for v in row] for row in layer_logits]
    imbalances = []
    for i, rows in enumerate(per_layer):
        counts, zloss, mass = naive_router(rows, cfg.top_k, "softmax")
        scope = f"monitors/layer_{i:02d}"
        np.testing.assert_array_equal(readout.get(f"{scope}/moe_tokens_count"), counts)
        assert readout.get(f"{scope}/moe_router_zloss")[0] == pytest.approx(zloss, rel=1e-5)
        assert readout.get(f"{scope}/moe_topk_prob_mass")[0] == pytest.approx(mass, rel=1e-5)
        imbalance, cv, entropy = naive_load(counts)
        assert out[f"{scope}/moe_imbalance"] == pytest.approx(imbalance)
        assert out[f"{scope}/moe_load_cv"] == pytest.approx(cv)
        assert out[f"{scope}/moe_utilization_entropy_frac"] == pytest.approx(entropy)
        dead = sum(1 for c in counts if c == 0)
        assert out[f"{scope}/moe_dead_experts_count"] == dead
        imbalances.append(imbalance)
    assert out["monitors/global/moe_imbalance_mean"] == pytest.approx(np.mean(imbalances))
    assert out["monitors/global/moe_imbalance_max"] == pytest.approx(max(imbalances))
    total_tokens = sum(t.numel() for t in batches)
    assert readout.get("monitors/global/moe_tokens_count").sum() == 2 * cfg.top_k * total_tokens


def test_inactive_monitor_launches_nothing_and_derives_nothing():
    model = _demo()
    mon, ctx = _monitored(find_layers(model))
    mon.active = False
    with no_sync(cpu_as_device=True), torch.no_grad():
        model(torch.randint(0, 256, (2, 8)))
    (readout,) = ctx.metrics.flush(0, wait=True)
    assert mon.derive(readout) == {}
    assert not readout.present["monitors/layer_00/moe_tokens_count"].any()


# -- 2 gloo ranks, unequal token counts ------------------------------------------------

N_EXPERTS, TOP_K = 8, 2
# Rank 1 routes 4x more tokens. Each rank floods its own expert, so each rank alone is
# badly balanced while the summed load is less so: averaging per-rank imbalances
# (3.83 here) overstates the cluster's (3.21).
TOKENS = {0: 60, 1: 240}


def _rank_logits(rank):
    """Seeded logits; each rank prefers different experts, so their loads differ."""
    g = torch.Generator().manual_seed(100 + rank)
    bias = torch.zeros(N_EXPERTS)
    bias[rank * 3] = 2.5  # rank 0 floods expert 0, rank 1 expert 3
    bias[7] = -6.0  # expert 7 gets (almost surely) nothing anywhere
    return torch.randn(TOKENS[rank], N_EXPERTS, generator=g) + bias


def _dist_worker(rank, world):
    (gate,), model_map = _identity_router(N_EXPERTS, TOP_K)
    mon, ctx = _monitored(model_map)
    with no_sync(cpu_as_device=True):
        gate(_rank_logits(rank))
    (readout,) = ctx.metrics.flush(0, wait=True)
    keys = ("moe_tokens_count", "moe_router_zloss", "moe_topk_prob_mass")
    values = {k: readout.get(f"monitors/layer_00/{k}") for k in keys}
    return mon.derive(readout), values


@pytest.mark.dist
def test_two_ranks_derive_from_summed_counts():
    results = spawn_gloo(_dist_worker, 2)
    per_rank = [naive_router(_rank_logits(r).tolist(), TOP_K, "softmax") for r in (0, 1)]
    counts = [a + b for a, b in zip(per_rank[0][0], per_rank[1][0], strict=True)]
    union = naive_router(_rank_logits(0).tolist() + _rank_logits(1).tolist(), TOP_K, "softmax")
    assert union[0] == counts
    imbalance, cv, entropy = naive_load(counts)
    for out, values in results:  # every rank derives the same cluster-wide values
        np.testing.assert_array_equal(values["moe_tokens_count"], counts)
        assert values["moe_router_zloss"][0] == pytest.approx(union[1], rel=1e-5)
        assert values["moe_topk_prob_mass"][0] == pytest.approx(union[2], rel=1e-5)
        assert out["monitors/layer_00/moe_imbalance"] == pytest.approx(imbalance)
        assert out["monitors/layer_00/moe_load_cv"] == pytest.approx(cv)
        assert out["monitors/layer_00/moe_utilization_entropy_frac"] == pytest.approx(entropy)
        assert out["monitors/layer_00/moe_dead_experts_count"] == counts.count(0)
    # The per-rank imbalances averaged are a different (wrong) number.
    averaged = np.mean([naive_load(per_rank[r][0])[0] for r in (0, 1)])
    assert abs(averaged - imbalance) > 0.2
