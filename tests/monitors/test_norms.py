"""NormsMonitor against naive references: per-layer parameter, gradient and update norms
on the demo model, cadence, and 2 gloo ranks with replicated and sharded parameters."""

import math

import pytest
import torch
from torch import nn

from syncless import kernels
from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.demo.parallel import is_expert_param
from syncless.guard import no_sync
from syncless.metrics import MetricSet
from syncless.monitors.adapters import LayerSite, ModelMap, find_layers
from syncless.monitors.base import MonitorContext
from syncless.monitors.norms import NormsMonitor
from syncless.testing import spawn_gloo


def sumsq(tensors):
    """Sum of squares, value by value, in Python floats."""
    return math.fsum(v * v for t in tensors for v in t.detach().double().reshape(-1).tolist())


def _monitored(model_map, optimizer, **kwargs):
    mon = NormsMonitor(optimizer, **kwargs)
    ctx = MonitorContext(model_map, MetricSet())
    mon.prepare(ctx)
    ctx.metrics.allocate("cpu")
    mon.attach(ctx)
    return mon, ctx


def _demo(seed=0):
    torch.manual_seed(seed)
    model = MoETransformer(preset("tiny"))
    init_weights(model, seed)
    return model


def _backward(model, seed):
    g = torch.Generator().manual_seed(seed)
    logits, balance = model(torch.randint(0, 256, (2, 12), generator=g))
    (logits.square().mean() + balance).backward()


def test_demo_model_norms_match_a_naive_recount():
    model = _demo()
    # SGD with momentum and weight decay: its step is sync-free, so the optimizer hooks
    # run under no_sync with the step itself.
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    mon, ctx = _monitored(find_layers(model), opt, every=1)
    for step in range(2):  # the second step has momentum: a different update
        opt.zero_grad()
        with no_sync(cpu_as_device=True):
            _backward(model, step)
        before = [[p.detach().clone() for p in block.parameters()] for block in model.layers]
        grads = [[p.grad.clone() for p in block.parameters()] for block in model.layers]
        with no_sync(cpu_as_device=True):
            opt.step()
        (readout,) = ctx.metrics.flush(step, wait=True)
        out = mon.derive(readout)
        totals = [0.0, 0.0, 0.0]
        for i, block in enumerate(model.layers):
            after = list(block.parameters())
            p, g = sumsq(before[i]), sumsq(grads[i])
            u = sumsq([a - b for a, b in zip(after, before[i], strict=True)])
            assert u > 0
            scope = f"monitors/layer_{i:02d}"
            assert out[f"{scope}/param_norm"] == pytest.approx(math.sqrt(p), rel=1e-5)
            assert out[f"{scope}/grad_norm"] == pytest.approx(math.sqrt(g), rel=1e-5)
            assert out[f"{scope}/update_ratio"] == pytest.approx(math.sqrt(u / p), rel=1e-4)
            totals = [totals[0] + p, totals[1] + g, totals[2] + u]
        p, g, u = totals
        assert out["monitors/global/param_norm"] == pytest.approx(math.sqrt(p), rel=1e-5)
        assert out["monitors/global/grad_norm"] == pytest.approx(math.sqrt(g), rel=1e-5)
        assert out["monitors/global/update_ratio"] == pytest.approx(math.sqrt(u / p), rel=1e-4)
        # embed.weight and the final norm are the optimizer's, outside every layer
        assert out["monitors/global/norms_unmonitored_params_count"] == 2
    # the fused kernels ran on the Triton backend (one launch per quantity and bucket)
    fused = [f for f in mon._fused if f is not None]
    assert bool(fused) == (kernels.backend() == "triton")
    assert all(f._rings[0].uploads >= 1 and f._rings[1].uploads >= 1 for f in fused)


def test_update_norm_survives_a_busy_offsets_buffer(monkeypatch):
    """When the post-step finds no offsets buffer free, the fused snapshot is read back
    through foreach ops: the same update norms as a naive recount."""
    if kernels.backend() != "triton":
        pytest.skip("the fused norms path is the Triton path")
    from syncless.monitors import norms_passes as norms_module

    state = {"post": False, "refused": 0}
    real = norms_module.FusedBucket._offsets

    def refused_after_the_step(self, tensors, ring):
        if state["post"]:
            state["refused"] += 1
            return None
        return real(self, tensors, ring)

    monkeypatch.setattr(norms_module.FusedBucket, "_offsets", refused_after_the_step)
    model = _demo()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mon, ctx = _monitored(find_layers(model), opt, every=1)
    # registered after the monitor's pre-hook, so it runs after it
    opt.register_step_pre_hook(lambda *_: state.update(post=True))
    with no_sync(cpu_as_device=True):
        _backward(model, 0)
    before = [[p.detach().clone() for p in block.parameters()] for block in model.layers]
    with no_sync(cpu_as_device=True):
        opt.step()
    assert state["refused"] == 1
    assert isinstance(mon._fused[0], norms_module.FusedBucket)
    (readout,) = ctx.metrics.flush(0, wait=True)
    out = mon.derive(readout)
    for i, block in enumerate(model.layers):
        p = sumsq(before[i])
        u = sumsq([a - b for a, b in zip(block.parameters(), before[i], strict=True)])
        got = out[f"monitors/layer_{i:02d}/update_ratio"]
        assert got == pytest.approx(math.sqrt(u / p), rel=1e-4)


@pytest.mark.parametrize("which", ["all", "one"])
def test_gradients_in_another_dtype_than_the_parameters(which):
    """bfloat16 gradients of float32 parameters. All of them: still one fused launch
    (the kernel reads each pointer in its own dtype). One of them: the gradients' dtypes
    are mixed, so the gradients take the foreach path and the parameters stay fused.
    Either way the norms match a naive recount."""
    model = _demo()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mon, ctx = _monitored(find_layers(model), opt, every=1)
    with no_sync(cpu_as_device=True):
        _backward(model, 0)
    monitored = [p for block in model.layers for p in block.parameters()]
    for p in monitored if which == "all" else monitored[1:2]:
        grad = p.grad.bfloat16()
        p.grad_dtype = None  # torch refuses a gradient of another dtype otherwise
        p.grad = grad
    before = [[p.detach().clone() for p in block.parameters()] for block in model.layers]
    grads = [[p.grad.clone() for p in block.parameters()] for block in model.layers]
    with no_sync(cpu_as_device=True):
        opt.step()
    (readout,) = ctx.metrics.flush(0, wait=True)
    out = mon.derive(readout)
    for i, block in enumerate(model.layers):
        p, g = sumsq(before[i]), sumsq(grads[i])
        u = sumsq([a - b for a, b in zip(block.parameters(), before[i], strict=True)])
        scope = f"monitors/layer_{i:02d}"
        assert out[f"{scope}/param_norm"] == pytest.approx(math.sqrt(p), rel=1e-5)
        assert out[f"{scope}/grad_norm"] == pytest.approx(math.sqrt(g), rel=1e-5)
        assert out[f"{scope}/update_ratio"] == pytest.approx(math.sqrt(u / p), rel=1e-4)
    (fused,) = mon._fused
    if fused is not None:  # the Triton backend
        assert fused._rings[0].uploads >= 1  # the parameters: fused
        assert (fused._rings[1].uploads >= 1) == (which == "all")


def test_a_parameter_swapped_after_attach_is_not_read_through_a_stale_table():
    """``p.data = <another size>`` after attach: the fused block table no longer fits, the
    bucket takes the foreach path, and the norms still match a naive recount."""
    model = _demo()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mon, ctx = _monitored(find_layers(model), opt, every=1, update_ratio=False)
    w = model.layers[0].attn.q_proj.weight
    w.data = torch.randn(w.shape[0] // 2, w.shape[1])  # fewer elements than at attach
    model.layers[0].attn.q_proj.weight.grad = torch.randn_like(w.data)
    grads = [[p.grad.clone() if p.grad is not None else torch.zeros_like(p)
              for p in block.parameters()] for block in model.layers]  # fmt: skip
    before = [[p.detach().clone() for p in block.parameters()] for block in model.layers]
    with no_sync(cpu_as_device=True):
        opt.step()
    (readout,) = ctx.metrics.flush(0, wait=True)
    out = mon.derive(readout)
    p0 = sumsq(before[0])
    assert out["monitors/layer_00/param_norm"] == pytest.approx(math.sqrt(p0), rel=1e-5)
    g0 = sumsq(grads[0])
    assert out["monitors/layer_00/grad_norm"] == pytest.approx(math.sqrt(g0), rel=1e-5)


def test_inactive_step_records_nothing_and_keeps_no_copy():
    model = _demo()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, ctx = _monitored(find_layers(model), opt)
    assert mon.every == 10
    mon.active = False
    _backward(model, 0)
    with no_sync(cpu_as_device=True):
        opt.step()
    assert mon._snapshot is None
    (readout,) = ctx.metrics.flush(0, wait=True)
    assert mon.derive(readout) == {}
    assert not any(readout.present[k].any() for k in readout.values)


def test_without_update_ratio_no_copy_and_no_update_metric():
    model = _demo()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, ctx = _monitored(find_layers(model), opt, every=1, update_ratio=False)
    assert not [s for s in ctx.metrics.specs if s.name.startswith("update")]
    _backward(model, 0)
    with no_sync(cpu_as_device=True):
        opt.step()
        assert mon._snapshot is None
    (readout,) = ctx.metrics.flush(0, wait=True)
    out = mon.derive(readout)
    assert "monitors/layer_00/param_norm" in out and "monitors/layer_00/grad_norm" in out
    assert not [k for k in out if "update_ratio" in k]


def test_missing_gradients_and_frozen_parameters():
    model = _demo()
    frozen = model.layers[1].attn.q_proj.weight
    frozen.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    mon, ctx = _monitored(find_layers(model), opt, every=1)
    _backward(model, 0)
    model.layers[0].attn.k_proj.weight.grad = None  # a parameter without a gradient
    block0 = list(model.layers[0].parameters())
    block1 = [p for p in model.layers[1].parameters() if p is not frozen]
    p0, p1 = sumsq(block0), sumsq(block1)
    g0 = sumsq([p.grad for p in block0 if p.grad is not None])
    with no_sync(cpu_as_device=True):
        opt.step()
    (readout,) = ctx.metrics.flush(0, wait=True)
    out = mon.derive(readout)
    assert out["monitors/layer_00/param_norm"] == pytest.approx(math.sqrt(p0), rel=1e-5)
    assert out["monitors/layer_00/grad_norm"] == pytest.approx(math.sqrt(g0), rel=1e-5)
    assert out["monitors/layer_01/param_norm"] == pytest.approx(math.sqrt(p1), rel=1e-5)
    (fused,) = mon._fused
    if fused is not None:  # the Triton backend: parameters fused, gradients by foreach
        assert fused._rings[0].uploads >= 1 and fused._rings[1].uploads == 0


def test_close_removes_the_optimizer_hooks():
    model = _demo()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, ctx = _monitored(find_layers(model), opt, every=1)
    mon.close()
    _backward(model, 0)
    opt.step()
    (readout,) = ctx.metrics.flush(0, wait=True)
    assert mon.derive(readout) == {}


@pytest.mark.parametrize("with_model", [False, True])
def test_is_sharded_sees_names_the_demo_predicate_understands(with_model):
    model = _demo()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def is_sharded(name):
        seen.append(name)
        return is_expert_param(name)

    kwargs = {"model": model} if with_model else {}
    _, ctx = _monitored(find_layers(model), opt, is_sharded=is_sharded, **kwargs)
    assert "layers.0.moe.experts.w_gate" in seen
    keys = {s.key for s in ctx.metrics.specs}
    for layer in (0, 1):
        for q in ("param", "grad", "update"):
            assert f"monitors/layer_{layer:02d}/{q}_sumsq_sharded" in keys
            assert f"monitors/layer_{layer:02d}/{q}_sumsq_replicated" in keys
    agg = {s.key: s.agg for s in ctx.metrics.specs}
    assert agg["monitors/layer_00/param_sumsq_sharded"] == "sum"
    assert agg["monitors/layer_00/param_sumsq_replicated"] == "max"


# -- 2 gloo ranks: replicated params counted once, sharded params summed ---------------


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(2, 3, 5))


class _Block(nn.Module):
    """A dense (replicated) Linear and an expert shard that differs per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 6)
        self.experts = _Experts()


def _values(rank, layer, what):
    """Seeded values: the dense ones equal on every rank, the expert shard per rank."""
    shapes = {"dense.weight": (6, 4), "dense.bias": (6,), "experts.w": (2, 3, 5)}
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        owner = rank if name.startswith("experts") else -1
        g = torch.Generator().manual_seed(1000 * layer + 100 * i + 10 * owner + len(what))
        out[name] = torch.randn(shape, generator=g)
    return out


def _dist_worker(rank, world):
    blocks = [_Block() for _ in range(2)]
    for layer, block in enumerate(blocks):
        params, grads = _values(rank, layer, "param"), _values(rank, layer, "grad")
        for name, p in block.named_parameters():
            p.data.copy_(params[name])
            p.grad = grads[name].clone()
    sites = [LayerSite(i, b, attention=None, router=None, mlp=None) for i, b in enumerate(blocks)]
    opt = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.25)
    mon, ctx = _monitored(
        ModelMap("test", sites, d_model=4), opt, every=1, is_sharded=is_expert_param
    )
    with no_sync(cpu_as_device=True):
        opt.step()
    (readout,) = ctx.metrics.flush(0, wait=True)
    return mon.derive(readout)


@pytest.mark.dist
def test_two_ranks_count_replicated_once_and_sum_shards():
    results = spawn_gloo(_dist_worker, 2)
    expected, doubled = {}, {}
    totals = [0.0, 0.0]
    for layer in (0, 1):
        p = g = 0.0
        for rank in (0, 1):
            params, grads = _values(rank, layer, "param"), _values(rank, layer, "grad")
            for name in params:
                if name.startswith("experts") or rank == 0:  # the union: dense once
                    p += sumsq([params[name]])
                    g += sumsq([grads[name]])
        scope = f"monitors/layer_{layer:02d}"
        # SGD without momentum: the update is lr * grad, so ||dp|| / ||p|| = lr ||g|| / ||p||
        expected[f"{scope}/param_norm"] = math.sqrt(p)
        expected[f"{scope}/grad_norm"] = math.sqrt(g)
        expected[f"{scope}/update_ratio"] = 0.25 * math.sqrt(g / p)
        dense = sumsq(_values(0, layer, "param").values()) - sumsq(
            [_values(0, layer, "param")["experts.w"]]
        )
        doubled[f"{scope}/param_norm"] = math.sqrt(p + dense)
        totals = [totals[0] + p, totals[1] + g]
    expected["monitors/global/param_norm"] = math.sqrt(totals[0])
    expected["monitors/global/grad_norm"] = math.sqrt(totals[1])
    expected["monitors/global/update_ratio"] = 0.25 * math.sqrt(totals[1] / totals[0])
    for out in results:
        for key, value in expected.items():
            assert out[key] == pytest.approx(value, rel=1e-5), key
        # Summing the replicated sums of squares over ranks would count them twice.
        for key, value in doubled.items():
            assert abs(out[key] - value) > 1e-2 * value
