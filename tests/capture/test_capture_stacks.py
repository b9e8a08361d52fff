"""Capture inside the stacks users train with, on the CPU: activation checkpointing,
``torch.compile`` (aot_eager: no C++ compiler needed) and gradient accumulation, with
copies immediate and deferred. Ground truth: the same model run again without hooks,
with the same weights and inputs. Hooks run under ``no_sync()``, except the compiled
steps: dynamo runs every frame eagerly while a ``TorchDispatchMode`` is active, which
``no_sync()`` is, so nothing would be compiled (the capture calls those steps make at
run time are the eager ones the other tests guard)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from syncless.capture import CaptureEngine, EngineConfig, MemorySink, recomputing
from syncless.guard import no_sync


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    """``reentrant``: None runs the blocks plainly, else through torch's checkpoint."""

    def __init__(self, d: int = 32, layers: int = 3, reentrant: bool | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


def reference_outputs(net: Net, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every block's MLP activation (its GELU's output) for every input, from a
    hook-free copy of ``net``."""
    clean = copy.deepcopy(net)
    out = []
    with torch.no_grad():
        for x in xs:
            for block in clean.blocks:
                out.append(block.mlp[1](block.mlp[0](block.norm(x))).clone())
                x = block(x)
    return out


def engine(defer: bool) -> CaptureEngine:
    config = EngineConfig(defer_copy_below=1 << 20 if defer else 0)
    return CaptureEngine(1 << 22, 1 << 20, MemorySink(), device="cpu", config=config)


def attach(net: Net, eng: CaptureEngine, state: dict) -> None:
    """A capture of every block's MLP activation, skipped in recomputes. The GELU's
    hook fires in a non-reentrant recompute too: torch stops that recompute early, once
    the saved tensors are back, which is after the GELU but before the block returns."""
    for i, block in enumerate(net.blocks):

        def hook(_module, _args, out, i=i) -> None:
            if torch.compiler.is_compiling() or not recomputing():
                eng.capture(f"block_{i}", out, step=state["step"])

        block.mlp[1].register_forward_hook(hook)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("defer", [False, True])
def test_activation_checkpointing_captures_each_block_once_per_step(
    defer: bool, reentrant: bool
) -> None:
    torch.manual_seed(0)
    net = Net(reentrant=reentrant)
    xs = [torch.randn(4, 32, requires_grad=reentrant) for _ in range(3)]
    want = reference_outputs(net, xs)
    eng, state = engine(defer), {"step": 0}
    attach(net, eng, state)
    recomputes = []
    net.blocks[0].mlp[1].register_forward_hook(lambda *_: recomputes.append(recomputing()))
    with no_sync():
        for step, x in enumerate(xs):
            state["step"] = step
            net(x).sum().backward()  # the backward recomputes every block
    eng.close()
    assert recomputes == [False, True] * 3  # the hook did fire twice per step
    got = eng.sink.records  # type: ignore[attr-defined]
    assert [(r.tag, r.step) for r in got] == [(f"block_{i}", s) for s in range(3) for i in range(3)]
    for r, w in zip(got, want, strict=True):
        torch.testing.assert_close(r.tensor(), w, rtol=0, atol=0)


@pytest.mark.parametrize("defer", [False, True])
def test_torch_compile_captures_what_the_compiled_blocks_computed(defer: bool) -> None:
    torch._dynamo.reset()
    torch.manual_seed(1)
    net = Net()
    xs = [torch.randn(4, 32) for _ in range(3)]
    want = reference_outputs(net, xs)
    eng, state = engine(defer), {"step": 0}
    attach(net, eng, state)
    compiled = torch.compile(net, backend="aot_eager")
    counters = torch._dynamo.utils.counters
    counters.clear()
    for step, x in enumerate(xs):
        state["step"] = step
        compiled(x).sum().backward()
    eng.close()
    assert counters["stats"]["unique_graphs"] > 0  # it did compile
    # capture() is one opaque call for dynamo: no graph break inside the engine.
    breaks = [reason for reason in counters["graph_break"] if "syncless/capture" in reason]
    assert breaks == [], breaks
    assert any("capture_outside_graph" in reason for reason in counters["graph_break"])
    got = eng.sink.records  # type: ignore[attr-defined]
    assert [(r.tag, r.step) for r in got] == [(f"block_{i}", s) for s in range(3) for i in range(3)]
    for r, w in zip(got, want, strict=True):
        # aot_eager runs the same aten ops; the order of a fused reduction may differ.
        torch.testing.assert_close(r.tensor(), w, rtol=1e-6, atol=1e-6)
    assert sum(eng.dropped().values()) == 0


def test_gradient_accumulation_captures_every_micro_batch_and_the_grads() -> None:
    """Four micro-batches per step: a block output each, then the accumulated gradient
    once, captured after the last backward and before the optimizer changes it."""
    torch.manual_seed(2)
    net = Net(layers=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    micro = [torch.randn(2, 32) for _ in range(4)]
    want_out = reference_outputs(net, micro)
    ref = copy.deepcopy(net)
    for x in micro:
        ref(x).sum().backward()
    want_grad = ref.blocks[0].mlp[0].weight.grad.clone()
    eng, state = engine(defer=True), {"step": 0}
    attach(net, eng, state)
    with no_sync():
        for x in micro:
            net(x).sum().backward()
        grad = net.blocks[0].mlp[0].weight.grad
        eng.capture("grad", grad, step=0, defer=False)  # the optimizer writes it next
    opt.step()
    opt.zero_grad()
    eng.close()
    got = eng.sink.records  # type: ignore[attr-defined]
    assert [r.tag for r in got] == ["block_0"] * 4 + ["grad"]
    for r, w in zip(got[:4], want_out, strict=True):
        torch.testing.assert_close(r.tensor(), w, rtol=0, atol=0)
    torch.testing.assert_close(got[4].tensor(), want_grad, rtol=1e-6, atol=1e-7)
