"""The gradients monitor on blocks whose outputs are DTensors, 2 gloo ranks: what
torchtitan's ``full_dtensor`` backend and tensor parallelism on DTensor activations
give it (and the activations and nonfinite monitors, which read the same outputs). A tiny residual stack, its parameters replicated (``distribute_module``), runs
on a batch sharded over the ranks (``Shard(0)``: each rank counts its own rows) and on
a replicated one (``Replicate()``: the ranks hold copies, one counts them).

Ground truth: the whole gradient at each block output (``full_tensor``, in the test).
At the second step an inf planted in its first element is one element in either case.
"""

from __future__ import annotations

import pytest
import torch
from output_grads import OutputGrads, StepLog, assert_recorded, attach_guarded, plant_inf
from torch import nn

from syncless.monitors.adapters import LayerSite, ModelMap
from syncless.testing import spawn_gloo

WIDTH, LAYERS = 16, 2


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class StackAdapter:
    """Maps ``Stack`` (the syncless adapter API: docs/adapters.md)."""

    name = "test-stack"

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, Stack)

    def map(self, model: nn.Module, first_layer: int = 0) -> ModelMap:
        sites = [
            LayerSite(first_layer + i, b, None, None, None) for i, b in enumerate(model.blocks)
        ]
        return ModelMap(self.name, sites, WIDTH)


def _keep_absmax(store: list[dict[int, torch.Tensor]], running: list[int], layer: int):
    """A forward hook: the whole output's max |x| (``full_tensor``: the test's collective)."""

    def hook(module: nn.Module, args, output: torch.Tensor) -> None:
        store[running[0]][layer] = output.full_tensor().abs().max()

    return hook


def _two_steps(mesh, placement) -> dict:
    from torch.distributed.tensor import distribute_module, distribute_tensor

    from syncless.guard import no_sync
    from syncless.monitors import build

    torch.manual_seed(0)
    model = distribute_module(Stack(), mesh)  # replicated parameters
    running = [0]  # the step
    plant_inf(model.blocks[0], lambda: running[0] == 1)
    absmax: list[dict[int, torch.Tensor]] = [{}, {}]  # by step, by layer
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(_keep_absmax(absmax, running, i))
    truth = OutputGrads(dict(enumerate(model.blocks)))
    # the output monitors read the same blocks, through the site's forward hook
    monitors = build("gradients,activations,nonfinite", every=1)
    log = StepLog(attach_guarded(model, monitors, lagged=False, budget=None), truth)
    for step in range(2):
        running[0] = step
        batch = torch.randn(4, 6, WIDTH, generator=torch.Generator().manual_seed(step))
        x = distribute_tensor(batch, mesh, [placement], src_data_rank=None)
        with no_sync(cpu_as_device=True):
            model(x).square().mean().backward()
        log.end_step(step)
    tops = [{layer: float(top) for layer, top in step.items()} for step in absmax]
    return {**log.close(), "act_absmax": tops}


def _worker(rank: int, world: int, placement: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from syncless.monitors.adapters import register_adapter

    register_adapter(StackAdapter())
    mesh = init_device_mesh("cpu", (world,))
    return _two_steps(mesh, Shard(0) if placement == "shard" else Replicate())


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("placement", ["shard", "replicate"])
def test_each_element_of_a_dtensor_gradient_counts_once(placement):
    ranks = spawn_gloo(_worker, 2, placement)
    # every gradient callback ran, under no_sync (rank 1's replicas return at once)
    assert [rank["calls"][1] for rank in ranks] == [4, 4]
    for step in range(2):
        want = ranks[0]["truth"][step]  # the whole gradient, on either rank
        assert want == ranks[1]["truth"][step]
        assert want[0].count == 4 * 6 * WIDTH
        assert want[0].nonfinite == step
        for rank in ranks:
            records = rank["records"][step]
            assert_recorded(records, want)
            # the output monitors read the rank's own part of the outputs too
            for layer, top in ranks[0]["act_absmax"][step].items():
                scope = f"monitors/layer_{layer:02d}"
                assert records[f"{scope}/act_absmax"] == pytest.approx(top, rel=1e-6)
                assert records[f"{scope}/nonfinite_count"] == 0
