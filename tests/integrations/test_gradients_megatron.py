"""The gradients monitor on Megatron-core, 2 gloo ranks (CPU, tests/megatron_harness.py):
tensor parallel 2 with and without sequence parallelism, and pipeline parallel 2
through Megatron's 1F1B schedule.

Ground truth: each rank keeps its block outputs' gradients with plain hooks
(tests/output_grads.py) and returns their sums and counts; the test assembles the
gradient of the whole layer output from them. Under sequence parallelism each rank
holds a slice of the sequence: the slices add up. Without it both ranks hold the whole
output and its whole gradient: rank 0's is the truth, and only rank 0 may record it
(``output_replica``). Both are the same model and batch, so their truths agree too.
At the second step an inf planted in the first element of layer 0's output gradient on
both ranks is one element without sequence parallelism and two with it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_harness import Parallel, batch, cuda_to_cpu, gpt_config, gpt_model, init_parallel
from output_grads import (
    GradTotals,
    OutputGrads,
    StepLog,
    assert_recorded,
    attach_guarded,
    combine,
    plant_inf,
)

from syncless.monitors.gradients import GradientsMonitor
from syncless.testing import spawn_gloo

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SEQ, LAYERS, MICRO_BATCHES = 16, 4, 4


def _truth(chunk: torch.nn.Module) -> OutputGrads:
    """Plain hooks on every block of the chunk, by Megatron's global layer number."""
    return OutputGrads({b.layer_number - 1: b for b in chunk.decoder.layers})


def _tensor_parallel(rank: int, world: int) -> dict:
    """Two steps with sequence parallelism, then two without, on the same weights."""
    init_parallel(Parallel(tp=2))
    return {sequence_parallel: _two_steps(sequence_parallel) for sequence_parallel in (True, False)}


def _two_steps(sequence_parallel: bool) -> dict:
    """The second step has the planted inf."""
    config = gpt_config(layers=2, parallel=Parallel(tp=2), sequence_parallel=sequence_parallel)
    torch.manual_seed(0)  # the same weights, split over the tensor-parallel ranks
    model = gpt_model(config, seq=SEQ)
    running = [0]  # the step
    plant_inf(model.decoder.layers[0], lambda: running[0] == 1)
    log = StepLog(
        attach_guarded(model, [GradientsMonitor()], lagged=False, budget=None), _truth(model)
    )
    for step in range(2):
        running[0] = step
        tokens, positions, labels, mask = batch(7 + step, seq=SEQ)  # the ranks share it
        model(tokens, positions, mask, labels=labels).float().mean().backward()
        log.end_step(step)
    return log.close()


def test_tensor_parallel_records_the_whole_output_gradient_once():
    ranks = spawn_gloo(_tensor_parallel, 2, timeout_s=180)
    # the monitor's hooks ran, under no_sync: a forward hook and a gradient per layer
    # and step, none on rank 1's copy of the output
    assert [rank[True]["calls"] for rank in ranks] == [(4, 4), (4, 4)]
    assert [rank[False]["calls"] for rank in ranks] == [(4, 4), (0, 0)]
    for step in range(2):
        sliced = combine(rank[True]["truth"][step] for rank in ranks)
        whole = ranks[0][False]["truth"][step]
        for layer in range(2):
            # both ranks hold the whole gradient without sequence parallelism; with it,
            # their slices make up the same gradient
            copy = ranks[1][False]["truth"][step][layer]
            assert copy.count == whole[layer].count == sliced[layer].count == 2 * SEQ * 64
            if step == 0 or layer > 0:
                assert copy.sq == pytest.approx(whole[layer].sq, rel=1e-6)
                assert sliced[layer].sq == pytest.approx(whole[layer].sq, rel=1e-5)
        planted = (sliced[0].nonfinite, whole[0].nonfinite)
        assert planted == ((2, 1) if step == 1 else (0, 0))
        for rank in ranks:
            assert_recorded(rank[True]["records"][step], sliced)
            assert_recorded(rank[False]["records"][step], whole)


def _loss(output: torch.Tensor):
    loss = output.float().mean()
    return loss, {"loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    tokens, positions, labels, mask = next(data_iterator)
    return model(tokens, positions, mask, labels=labels), _loss


def _pipeline(rank: int, world: int, recompute: bool) -> dict:
    """Pipeline 2, 4 layers (stage 0 holds layers 0-1, stage 1 layers 2-3), 1F1B over
    4 micro-batches, two steps. ``recompute``: Megatron's full recompute of each stage's
    two layers as one checkpointed group (its forward runs without grad, the recompute
    in the backward with it)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    parallel = Parallel(pp=2)
    init_parallel(parallel)
    overrides = {}
    if recompute:
        overrides = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2
        )
    config = gpt_config(
        layers=LAYERS, parallel=parallel, batch_p2p_comm=False, deallocate_pipeline_outputs=True,
        **overrides,
    )  # fmt: skip
    torch.manual_seed(rank)
    model = gpt_model(
        config,
        seq=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    log = StepLog(
        attach_guarded([model], [GradientsMonitor()], lagged=False, budget=None), _truth(model)
    )
    forward_backward = get_forward_backward_func()
    with cuda_to_cpu():
        for step in range(2):
            data = iter([batch(step * 10 + i, seq=SEQ) for i in range(MICRO_BATCHES)])
            forward_backward(
                forward_step_func=_forward_step, data_iterator=data, model=[model],
                num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=2,
            )  # fmt: skip
            log.end_step(step)
            model.zero_grad()
    return log.close()


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full-recompute"])
def test_pipeline_stages_record_their_layers_over_every_micro_batch(recompute):
    ranks = spawn_gloo(_pipeline, 2, recompute, timeout_s=180)
    assert sorted(ranks[0]["truth"][0]) == [0, 1] and sorted(ranks[1]["truth"][0]) == [2, 3]
    # each stage's hooks, under no_sync: a gradient once per layer and micro-batch (a
    # count doubled by the schedule or the recompute would leave the RMS as it is); the
    # forward hooks run again in the recompute
    calls = 2 * MICRO_BATCHES * 2
    forwards = 2 * calls if recompute else calls
    assert [rank["calls"] for rank in ranks] == [(forwards, calls), (forwards, calls)]
    for step in range(2):
        want: dict[int, GradTotals] = combine(rank["truth"][step] for rank in ranks)
        for layer in range(LAYERS):
            assert want[layer].count == MICRO_BATCHES * 2 * SEQ * 64
        for rank in ranks:
            assert_recorded(rank["records"][step], want)
