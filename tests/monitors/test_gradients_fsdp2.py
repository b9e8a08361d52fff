"""The gradients monitor under FSDP2 (``fully_shard`` per block and the root), 2 gloo ranks.

Each rank trains the demo's tiny model on its own batches, of a different size on each
rank, so that a mean of the ranks' means would differ from the mean over every element.
Ground truth: an unsharded copy of the model on each rank, with the same weights and
batches and nothing of syncless attached, keeps its block outputs' gradients
(tests/output_grads.py); the test adds both ranks' sums and counts. Step 0 is one
micro-batch, step 1 two (gradient accumulation), the second of them with an inf planted
in layer 0's output gradient on rank 1 only: the count is summed over the ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
from output_grads import OutputGrads, StepLog, assert_recorded, attach_guarded, combine, plant_inf

from syncless.testing import spawn_gloo

PLANTED = (1, 1, 0)  # step, micro-batch, layer


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from syncless.demo.config import preset
    from syncless.demo.model import MoETransformer, init_weights
    from syncless.guard import no_sync
    from syncless.monitors.gradients import GradientsMonitor

    torch.manual_seed(0)
    model = MoETransformer(preset("tiny"))
    init_weights(model, 0)
    reference = copy.deepcopy(model)
    at = [-1, -1]  # this rank's (step, micro-batch) now
    step, micro_batch, layer = PLANTED

    def armed() -> bool:
        return rank == 1 and at == [step, micro_batch]

    for m in (model, reference):  # before the monitor and the truth: they see the inf
        plant_inf(m.layers[layer], armed)
    truth = OutputGrads(dict(enumerate(reference.layers)))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # the whole step runs under no_sync; the guard counts the monitor's hook calls
    log = StepLog(attach_guarded(model, [GradientsMonitor()], lagged=False, budget=None), truth)
    g = torch.Generator().manual_seed(rank)
    for i, micro_batches in enumerate((1, 2)):
        for k in range(micro_batches):
            at[:] = [i, k]
            tokens = torch.randint(0, 256, (2 + rank, 16), generator=g)
            with no_sync(cpu_as_device=True):  # FSDP2's gathers and reduce-scatters too
                logits, balance = model(tokens)
                (logits.float().square().mean() + balance).backward()
            logits, balance = reference(tokens)
            (logits.float().square().mean() + balance).backward()
        log.end_step(i)
        model.zero_grad()
    return log.close()


@pytest.mark.dist
@pytest.mark.slow
def test_records_cover_every_element_of_both_ranks_batches():
    ranks = spawn_gloo(_worker, 2)
    # once per layer and micro-batch: a gradient counted twice would keep its RMS
    assert [rank["calls"] for rank in ranks] == [(6, 6), (6, 6)]
    planted_step, _, planted_layer = PLANTED
    for step in range(2):
        want = combine(rank["truth"][step] for rank in ranks)
        assert want[planted_layer].nonfinite == (1 if step == planted_step else 0)
        for rank in ranks:  # the flush's reduce gives every rank the cluster's values
            assert_recorded(rank["records"][step], want)
