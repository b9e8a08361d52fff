"""``SynclessMegatron`` hands every iteration's loss and gradient norm to the monitors as
device tensors, on the CPU (megatron-core 0.16.1, one gloo rank).

Megatron's own pieces: its ``DistributedDataParallel``, the ``ChainedOptimizer`` of an
``FP32Optimizer`` that ``get_megatron_optimizer`` builds, and its no-pipelining
schedule. The loss comes from what ``loss_func`` returned per micro-batch, in
Megatron-LM's ``[loss sum, tokens]`` form; the gradient norm from the optimizer's
``step()``, which Megatron has already read to the host. Ground truth: the sums and
token counts ``loss_func`` saw, and the norm the optimizer returned. A NaN planted in
the loss at one iteration, and in one gradient at another, is reported with its
iteration. Megatron clips on the CUDA device only (``clip_grad_by_total_norm_fp32``
asserts CUDA tensors): ``clip_grad=0``; the chained optimizer computes the norm anyway.
The monitors' hooks, the loss's reduction and the norm's fill run under ``no_sync()``;
Megatron's own forward cannot (on the CPU its RoPE moves a table "to the GPU" at each
forward, and its optimizer reads the norm).
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

pytest.importorskip("megatron.core")

from hook_guard import HookGuard
from integration_helpers import handed_over
from megatron_harness import batch, cuda_to_cpu, gpt_config, gpt_model, single_process

import syncless.integrations.megatron as integration
from syncless.guard import no_sync
from syncless.integrations.megatron import SynclessMegatron, reduced_loss
from syncless.run import Run
from syncless.run import open as open_run

ITERATIONS, MICRO_BATCHES = 6, 2
LOSS_NAN, GRAD_NAN = 2, 4
LOSS_FAULT, GRAD_FAULT = torch.zeros(()), torch.zeros(())


def _loss(seen: list, output: torch.Tensor):
    """Megatron-LM's form: (loss sum, tokens, {"lm loss": [sum, tokens]})."""
    total = output.float().sum() + LOSS_FAULT
    tokens = torch.tensor(output.numel(), dtype=torch.int)
    seen.append((total.detach().clone(), tokens))
    return total, tokens, {"lm loss": torch.cat([total.detach().view(1), tokens.view(1)])}


def _forward_step(seen: list, data_iterator, model):
    tokens, positions, labels, mask = next(data_iterator)
    return model(tokens, positions, mask, labels=labels), partial(_loss, seen)


def _under_no_sync(function):
    def guarded(*args, **kwargs):
        with no_sync(cpu_as_device=True):
            return function(*args, **kwargs)

    return guarded


def test_the_loss_and_megatrons_grad_norm_reach_the_alarm_each_iteration(tmp_path, monkeypatch):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    given = handed_over(monkeypatch)
    monkeypatch.setattr(integration, "reduced_loss", _under_no_sync(reduced_loss))
    device_norm = SynclessMegatron._device_norm
    monkeypatch.setattr(SynclessMegatron, "_device_norm", _under_no_sync(device_norm))
    hooks = HookGuard()
    seen: list = []
    norms = []
    with single_process(), cuda_to_cpu():
        config = gpt_config()
        torch.manual_seed(0)
        model = gpt_model(config)
        ddp = DistributedDataParallel(
            config=config, ddp_config=DistributedDataParallelConfig(), module=model
        )
        config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), [ddp]
        )
        model.decoder.layers[0].mlp.linear_fc1.weight.register_hook(lambda g: g + GRAD_FAULT)
        iteration = 0

        def clean(adam, args, kwargs):  # after Megatron's norm, before Adam's update
            if iteration == GRAD_NAN:  # no NaN weights: training is clean again after
                for group in adam.param_groups:
                    for p in group["params"]:
                        p.grad.zero_()

        optimizer.chained_optimizers[0].optimizer.register_step_pre_hook(clean)
        hooks.snapshot(model)
        observer = SynclessMegatron(
            [ddp],
            optimizer,
            monitors="nonfinite,activations",
            run=Run(run_dir=str(tmp_path)),
            budget=None,  # the alarm read at every iteration
        )
        assert hooks.guard(model) > 0
        forward_backward = observer.forward_backward(get_forward_backward_func())
        for iteration in range(ITERATIONS):
            LOSS_FAULT.fill_(math.nan if iteration == LOSS_NAN else 0.0)
            GRAD_FAULT.fill_(math.nan if iteration == GRAD_NAN else 0.0)
            ddp.zero_grad_buffer()
            data = iter([batch(iteration * 10 + i) for i in range(MICRO_BATCHES)])
            forward_backward(
                forward_step_func=partial(_forward_step, seen), data_iterator=data,
                model=[ddp], num_microbatches=MICRO_BATCHES, seq_length=16,
                micro_batch_size=2, forward_only=False,
            )  # fmt: skip
            succeeded, norm, _ = observer.optimizer_step(optimizer)
            assert succeeded
            norms.append(norm)
            observer.step(iteration)
        observer.close()
        observer.run.close()
    assert hooks.calls > 0

    assert sorted(given) == list(range(ITERATIONS))
    for i, (loss, grad_norm) in given.items():
        sums, tokens = zip(*seen[i * MICRO_BATCHES : (i + 1) * MICRO_BATCHES], strict=True)
        want = sum(float(s) for s in sums) / sum(int(t) for t in tokens)
        assert math.isclose(loss, want, rel_tol=1e-6) or (i == LOSS_NAN and math.isnan(loss))
        assert grad_norm == pytest.approx(norms[i], rel=1e-6, nan_ok=True)
    assert [i for i, (loss, _) in given.items() if math.isnan(loss)] == [LOSS_NAN]
    assert [i for i, (_, norm) in given.items() if math.isnan(norm)] == [GRAD_NAN]
    with open_run(str(tmp_path)) as store:
        _, rows = store.query(
            "SELECT name, step, value FROM metrics WHERE name LIKE 'monitors/step/%_first_step'"
        )
    firsts = {name.split("/")[-1]: (step, value) for name, step, value in rows}
    assert firsts["loss_nonfinite_first_step"] == (LOSS_NAN, LOSS_NAN)
    assert firsts["grad_norm_nonfinite_first_step"] == (GRAD_NAN, GRAD_NAN)


def test_the_loss_reduces_as_megatron_lm_reports_it():
    pairs = [{"lm loss": torch.tensor([6.0, 3.0])}, {"lm loss": torch.tensor([2.0, 1.0])}]
    assert reduced_loss(pairs).item() == 2.0  # (6 + 2) / (3 + 1), not the mean of 2 and 2
    scalars = [{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(3.0)}]
    assert reduced_loss(scalars).item() == 2.0  # the only key, a mean over micro-batches
    two_keys = [{"lm loss": torch.tensor(1.0), "z": torch.tensor(5.0)}]
    assert reduced_loss(two_keys).item() == 1.0
    assert reduced_loss(two_keys, key="z").item() == 5.0
    assert reduced_loss([{"loss": 1.5}]) is None  # a number already on the host
    assert reduced_loss([]) is None  # a pipeline stage without the loss
