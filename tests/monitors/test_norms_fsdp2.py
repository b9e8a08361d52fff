"""The norms monitor under FSDP2 (``fully_shard``: DTensor parameters and gradients).

Two gloo ranks train the demo's tiny model sharded layer by layer. Ground truth: the
full parameters and gradients, gathered in the test only (``full_tensor()``), before
and after the optimizer step, in float64. The monitor must find the sharding from the
DTensors themselves (no ``is_sharded`` predicate) and add the shards' sums of squares
in the flush's SUM collective.
"""

from __future__ import annotations

import math

import pytest
import torch

from syncless.testing import spawn_gloo


def _full_sums(model) -> dict[int, tuple[float, float, torch.Tensor]]:
    """Per layer: (sum of squares of the parameters, of the gradients, the flat params)."""
    out = {}
    for i, layer in enumerate(model.layers):
        params = [p.detach().full_tensor().double().flatten() for p in layer.parameters()]
        grads = [p.grad.full_tensor().double().flatten() for p in layer.parameters()]
        flat = torch.cat(params)
        out[i] = (float(flat.square().sum()), float(torch.cat(grads).square().sum()), flat)
    return out


def _guarded(hooks: dict) -> None:
    """Run each optimizer hook under no_sync: the hooks are the monitor's; the step
    around them is not (torch's single-tensor Adam, which DTensors take, reads its step
    count on the host)."""
    from syncless.guard import no_sync

    def guard(fn):
        def guarded(*args, **kwargs):
            with no_sync(cpu_as_device=True):
                return fn(*args, **kwargs)

        return guarded

    for key, fn in list(hooks.items()):
        hooks[key] = guard(fn)


def _worker(rank: int, world: int) -> dict[str, float] | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from syncless.demo.config import preset
    from syncless.demo.model import MoETransformer, init_weights
    from syncless.monitors import attach, build

    torch.manual_seed(0)
    model = MoETransformer(preset("tiny"))
    init_weights(model, 0)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    handle = attach(model, build(["norms"], optimizer=opt, every=1), lagged=False, budget=None)
    _guarded(opt._optimizer_step_pre_hooks)
    _guarded(opt._optimizer_step_post_hooks)
    # each rank its own batch: FSDP2 averages the gradients across ranks
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (2, 16), generator=g)
    logits, balance = model(tokens)
    (logits.float().square().mean() + balance).backward()
    before = _full_sums(model)
    opt.step()
    after = _full_sums(model)
    records = {r.name: r.value for r in handle.step(0)}
    handle.close()
    if rank != 0:
        return None
    want = {}
    for i, (p_sq, g_sq, flat) in before.items():
        scope = f"monitors/layer_{i:02d}"
        want[f"{scope}/param_norm"] = math.sqrt(p_sq)
        want[f"{scope}/grad_norm"] = math.sqrt(g_sq)
        update_sq = float((after[i][2] - flat).square().sum())
        want[f"{scope}/update_ratio"] = math.sqrt(update_sq / p_sq)
    return {"records": records, "want": want}


@pytest.mark.dist
def test_norms_of_fully_sharded_layers_are_the_full_tensors_norms():
    out = spawn_gloo(_worker, 2)[0]
    records, want = out["records"], out["want"]
    for name, value in want.items():
        assert records[name] == pytest.approx(value, rel=1e-5), name
    # the shards were recognised from the DTensors (no predicate): sum metrics only
    sums = {n.rsplit("/", 1)[-1] for n in records if "_sumsq_" in n}
    assert sums == {"param_sumsq_sharded", "grad_sumsq_sharded", "update_sumsq_sharded"}
