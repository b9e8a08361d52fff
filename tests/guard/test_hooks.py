"""Module and tensor hooks run under the guard when forward/backward run inside it."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from torch import nn

from syncless.guard import Site, SyncError, census, no_sync


class Stats:
    """On-device statistics gathered by hooks, plus host-side call counters."""

    def __init__(self) -> None:
        self.act_absmax = torch.zeros(())
        self.input_sum = torch.zeros(())
        self.grad_sq = torch.zeros(())
        self.out_grad_sum = torch.zeros(())
        self.calls: Counter[str] = Counter()


def make_model(stats: Stats, forward_extra=None, backward_extra=None, tensor_extra=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))

    def pre_forward(module, args):
        stats.calls["pre_forward"] += 1
        stats.input_sum.add_(args[0].detach().sum())

    def forward(module, args, out):
        stats.calls["forward"] += 1
        torch.maximum(stats.act_absmax, out.detach().abs().max(), out=stats.act_absmax)
        if forward_extra is not None:
            forward_extra(out)
        out.register_hook(tensor_hook)

    def tensor_hook(grad):
        stats.calls["tensor"] += 1
        stats.out_grad_sum.add_(grad.sum())
        if tensor_extra is not None:
            tensor_extra(grad)

    def backward(module, grad_input, grad_output):
        stats.calls["backward"] += 1
        stats.grad_sq.add_(grad_output[0].pow(2).sum())
        if backward_extra is not None:
            backward_extra(grad_output[0])

    model[0].register_forward_pre_hook(pre_forward)
    model[0].register_forward_hook(forward)
    model[2].register_full_backward_hook(backward)
    return model


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).sum()
    loss.backward()
    return loss


def test_device_side_hooks_pass_and_compute_the_right_values() -> None:
    stats = Stats()
    model = make_model(stats)
    x = torch.randn(4, 3, requires_grad=True)
    with no_sync(cpu_as_device=True):
        step(model, x)
    assert stats.calls == {"pre_forward": 1, "forward": 1, "tensor": 1, "backward": 1}
    # Ground truth: the same network recomputed by hand, without modules or hooks.
    w1, b1 = model[0].weight.detach(), model[0].bias.detach()
    w2, b2 = model[2].weight.detach(), model[2].bias.detach()
    h = x.detach() @ w1.T + b1
    out = h.relu() @ w2.T + b2
    grad_out = 2 * out
    assert torch.allclose(stats.act_absmax, h.abs().max())
    assert torch.allclose(stats.input_sum, x.detach().sum())
    assert torch.allclose(stats.grad_sq, grad_out.pow(2).sum())
    grad_h = (grad_out @ w2) * (h > 0)
    assert torch.allclose(stats.out_grad_sum, grad_h.sum())


def _item(t: torch.Tensor) -> None:
    t.sum().item()  # SYNC


def _tolist(t: torch.Tensor) -> None:
    t.tolist()  # SYNC


def _cpu(t: torch.Tensor) -> None:
    t.cpu()  # SYNC


def _where(t: torch.Tensor) -> None:
    torch.where(t > 0)  # SYNC


@pytest.mark.parametrize(
    ("hook", "fn", "op"),
    [
        ("forward_extra", _item, "Tensor.item"),
        ("forward_extra", _cpu, "Tensor.cpu"),
        ("backward_extra", _item, "Tensor.item"),
        ("backward_extra", _tolist, "Tensor.tolist"),
        ("tensor_extra", _cpu, "Tensor.cpu"),
        ("tensor_extra", _where, "aten.nonzero"),
    ],
)
def test_syncing_hook_raises_at_the_hook_line(hook, fn, op, marked_line) -> None:
    model = make_model(Stats(), **{hook: fn})
    with no_sync(cpu_as_device=True), pytest.raises(SyncError) as caught:
        step(model, torch.randn(4, 3))
    assert caught.value.op == op
    assert caught.value.site == Site(__file__, marked_line(fn), fn.__name__)


def test_backward_through_autograd_grad_is_guarded_too() -> None:
    model = make_model(Stats(), backward_extra=_tolist)
    loss = None
    with no_sync(cpu_as_device=True), pytest.raises(SyncError, match=r"Tensor\.tolist"):
        loss = model(torch.randn(4, 3)).sum()
        torch.autograd.grad(loss, list(model.parameters()))
    assert loss is not None


def test_census_counts_every_hook_call(marked_line) -> None:
    stats = Stats()
    model = make_model(stats, forward_extra=_item, backward_extra=_tolist, tensor_extra=_cpu)
    steps, batches_per_step = 3, 2
    with census(cpu_as_device=True) as c:
        for _ in range(steps):
            for _ in range(batches_per_step):
                step(model, torch.randn(4, 3))
            c.step()
    calls = batches_per_step * steps
    assert stats.calls == {
        "pre_forward": calls,
        "forward": calls,
        "tensor": calls,
        "backward": calls,
    }
    assert c.by_site() == {
        (Site(__file__, marked_line(_item), "_item"), "Tensor.item"): calls,
        (Site(__file__, marked_line(_tolist), "_tolist"), "Tensor.tolist"): calls,
        (Site(__file__, marked_line(_cpu), "_cpu"), "Tensor.cpu"): calls,
    }
    assert c.per_step() == dict.fromkeys(range(steps), 3 * batches_per_step)


def test_cpu_backward_hooks_run_on_the_calling_thread() -> None:
    """Why the guard covers CPU backward: the engine runs CPU work on the caller's thread."""
    seen: list[int] = []
    model = make_model(Stats(), backward_extra=lambda g: seen.append(threading.get_ident()))
    with no_sync(cpu_as_device=True):
        step(model, torch.randn(4, 3))
    assert seen == [threading.get_ident()]
