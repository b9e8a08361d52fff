"""Pipeline stages on 2 gloo ranks: rank 0 derives every stage's layers (issue #20).

Each rank holds two layers of a four-layer model (``layer_offsets``) and runs its own
input. Rank 1's stage holds the extremes (the largest activations and logits, a router
that floods one expert and starves another), so a global that misses a stage is
wrong, not only incomplete. Ground truth comes from plain forward hooks and a naive
recomputation on each rank, gathered on rank 0.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.monitors import attach
from syncless.monitors.activations import ActivationsMonitor
from syncless.monitors.attention import AttentionMonitor
from syncless.monitors.moe import MoEMonitor
from syncless.monitors.norms import NormsMonitor
from syncless.testing import spawn_gloo

LAYERS = 2  # per stage: the tiny preset's layer count
THRESHOLDS = (0.06, 0.5, 1.5)  # each stage has channels on either side of one


def _stage(rank: int) -> MoETransformer:
    torch.manual_seed(rank)
    model = MoETransformer(preset("tiny"))
    init_weights(model, seed=rank)
    if rank == 1:
        _skew(model)
    return model


@torch.no_grad()
def _skew(model: MoETransformer) -> None:
    """Stage 1 holds every extreme: larger activations, sharper attention in its last
    layer, and a first router where expert 0 takes every token and expert 3 none."""
    model.embed.weight.mul_(30.0)
    model.layers[1].attn.q_proj.weight.mul_(40.0)
    router = model.layers[0].moe.router
    gate = nn.Linear(router.gate.in_features, router.gate.out_features, bias=True)
    gate.weight.copy_(router.gate.weight)
    gate.bias.copy_(torch.tensor([50.0, 0.0, 0.0, -50.0]))
    router.gate = gate


def _keep(store: dict[int, Any], layer: int, inputs: bool):
    """A plain forward hook that keeps a copy of a module's first input or output."""

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        value = args[0] if inputs else output
        value = value[0] if isinstance(value, tuple) else value
        store[layer] = value.detach().clone()

    return hook


def _naive_counts(logits: np.ndarray, top_k: int) -> list[int]:
    """Tokens per expert, each token counted for its top-k logits (a plain recount)."""
    counts = [0] * logits.shape[1]
    for row in logits:
        for expert in np.argsort(-row, kind="stable")[:top_k]:
            counts[int(expert)] += 1
    return counts


def _naive_attention(attn: nn.Module, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per head: the largest causal q.k logit and the mean row entropy (nats), in float64
    from q and k recomputed with the model's own projections."""
    b, seq, _ = x.shape

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, seq, attn.n_heads, attn.head_dim).transpose(1, 2)

    with torch.no_grad():
        q = attn.rotary(heads(attn.q_proj(x))).double().numpy()
        k = attn.rotary(heads(attn.k_proj(x))).double().numpy()
    logits = np.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(attn.head_dim)
    allowed = np.tril(np.ones((seq, seq), dtype=bool))
    logits = np.where(allowed, logits, -np.inf)
    top = logits.max(axis=(0, 2, 3))
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    row_entropy = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(axis=-1)
    return top, row_entropy.mean(axis=(0, 2))


def _naive_load(counts: list[int]) -> tuple[float, float, float, int]:
    """Imbalance (max / mean), population CV, entropy fraction and dead experts."""
    n, total = len(counts), sum(counts)
    mean = total / n
    std = math.sqrt(sum((c - mean) ** 2 for c in counts) / n)
    entropy = -sum(c / total * math.log(c / total) for c in counts if c)
    return max(counts) / mean, std / mean, entropy / math.log(n), counts.count(0)


def _stage_worker(rank: int, world: int) -> dict[str, float]:
    model = _stage(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    offset = rank * LAYERS
    logits: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    attn_inputs: dict[int, torch.Tensor] = {}
    for i, block in enumerate(model.layers):
        block.moe.router.gate.register_forward_hook(_keep(logits, offset + i, inputs=False))
        block.register_forward_hook(_keep(outputs, offset + i, inputs=False))
        block.attn.register_forward_hook(_keep(attn_inputs, offset + i, inputs=True))
    monitors = [
        MoEMonitor(),
        ActivationsMonitor(thresholds=THRESHOLDS),
        AttentionMonitor(),
        NormsMonitor(opt, every=1, update_ratio=False),
    ]
    handle = attach(model, monitors, lagged=False, layer_offsets=[offset], budget=None)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(10 + rank))
    with no_sync(cpu_as_device=True):
        out, balance = model(tokens)
        (out.float().square().mean() + balance).backward()
    grads = {i: [p.grad.double().square().sum() for p in b.parameters()] for i, b in
             enumerate(model.layers)}  # fmt: skip
    params = {i: [p.detach().double().square().sum() for p in b.parameters()] for i, b in
              enumerate(model.layers)}  # fmt: skip
    with no_sync(cpu_as_device=True):
        opt.step()  # the norms monitor's hooks run in the step
    records = {r.name: r.value for r in handle.step(0)}
    handle.close()

    top_k = preset("tiny").top_k
    reference = {}
    for i, block in enumerate(model.layers):
        layer = offset + i
        head_max, head_entropy = _naive_attention(block.attn, attn_inputs[layer])
        reference[layer] = {
            "counts": _naive_counts(logits[layer].double().numpy(), top_k),
            "channels": outputs[layer].abs().amax(dim=(0, 1)).double().numpy(),
            "head_max": head_max,
            "head_entropy": head_entropy,
            "param_norm": math.sqrt(float(sum(params[i]))),
            "grad_norm": math.sqrt(float(sum(grads[i]))),
        }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, reference)
    if rank == 0:
        _check(records, {layer: v for part in gathered for layer, v in part.items()})
    return records


def _check(records: dict[str, float], reference: dict[int, dict[str, Any]]) -> None:
    """Every layer of both stages derived from the naive values, and globals over all."""
    assert sorted(reference) == [0, 1, 2, 3]
    loads, absmax = {}, {}
    for layer, ref in reference.items():
        scope = f"monitors/layer_{layer:02d}"
        loads[layer] = imbalance, cv, entropy, dead = _naive_load(ref["counts"])
        assert records[f"{scope}/moe_imbalance"] == pytest.approx(imbalance, rel=1e-12)
        assert records[f"{scope}/moe_load_cv"] == pytest.approx(cv, rel=1e-12)
        assert records[f"{scope}/moe_utilization_entropy_frac"] == pytest.approx(entropy)
        assert records[f"{scope}/moe_dead_experts_count"] == dead
        channels = ref["channels"]
        absmax[layer] = channels.max()
        assert records[f"{scope}/act_absmax"] == channels.max()
        ratio = channels.max() / np.median(channels)
        assert records[f"{scope}/act_max_median_ratio"] == pytest.approx(ratio, rel=1e-12)
        for norm in ("param_norm", "grad_norm"):
            assert records[f"{scope}/{norm}"] == pytest.approx(ref[norm], rel=1e-5)
        for t, label in zip(THRESHOLDS, ("0p06", "0p5", "1p5"), strict=True):
            name = f"{scope}/act_channels_above_{label}_count"
            assert records[name] == np.count_nonzero(channels > t)
    # Stage 1's first router floods expert 0 and starves expert 3 (the skew above).
    assert loads[2][0] == 2.0 and loads[2][3] == 1
    imbalances = [load[0] for load in loads.values()]
    assert records["monitors/global/moe_imbalance_max"] == max(imbalances)
    assert records["monitors/global/moe_imbalance_mean"] == pytest.approx(np.mean(imbalances))
    assert records["monitors/global/moe_dead_experts_count"] == sum(d for *_, d in loads.values())
    assert max(absmax, key=absmax.get) >= LAYERS  # the largest activation is stage 1's
    assert records["monitors/global/act_absmax"] == max(absmax.values())
    head_max = {layer: ref["head_max"].max() for layer, ref in reference.items()}
    assert max(head_max, key=head_max.get) == 3
    assert records["monitors/global/attn_qk_logit_max_layer"] == 3
    lowest = min(ref["head_entropy"].min() for ref in reference.values())
    assert lowest == min(reference[3]["head_entropy"])
    assert records["monitors/global/attn_entropy_nats_head_min"] == pytest.approx(lowest, rel=1e-4)
    total = math.sqrt(sum(ref["param_norm"] ** 2 for ref in reference.values()))
    assert records["monitors/global/param_norm"] == pytest.approx(total, rel=1e-5)


@pytest.mark.dist
def test_rank_zero_derives_every_stages_layers_from_the_union_schema():
    records = spawn_gloo(_stage_worker, 2)
    # Only what rank 0 emits is checked above; rank 1 derives the same cluster view.
    for name in ("moe_imbalance_max", "act_absmax", "attn_qk_logit_max_layer"):
        assert records[0][f"monitors/global/{name}"] == records[1][f"monitors/global/{name}"]
