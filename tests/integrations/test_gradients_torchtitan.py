"""The gradients monitor in torchtitan's stock ``Trainer`` on a CPU (one gloo rank):
torchtitan's ``parallelize_llama`` applies full activation checkpointing, a
``fullgraph`` compile of each block and FSDP2; two gradient-accumulation micro-batches
a step; ``SynclessMetricsProcessor`` attaches the monitor and flushes each step. Under
its default SPMD backend (``spmd_types``) the block outputs are plain tensors; under
``full_dtensor`` they are DTensors (there without the compile, which fails on the CPU
with or without syncless).

Ground truth: a plain eager copy of the model (tests/torchtitan_harness.py), nothing of
syncless attached, run beside the trainer on each micro-batch with the trainer's own
weights, inputs, loss function and token count; its block outputs keep their gradients
(tests/output_grads.py). FSDP2 computes in float32 here, as the copy does: in bfloat16
the two would differ by the rounding of every activation.

The monitor's gradient callbacks and each flush run under ``no_sync()``; its forward
hooks are traced into the compiled blocks (where a sync would break the fullgraph).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

import torch
from output_grads import OutputGrads, assert_recorded, combine, guarded_gradient_callbacks
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import default_adamw
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.trainer import Trainer
from torchtitan_harness import NoTokenizer, RandomTokens, build_model, model_spec, trainer_on_cpu

from syncless.guard import no_sync
from syncless.integrations.torchtitan import SynclessMetricsProcessor
from syncless.monitors import MonitorHandle
from syncless.run import open as open_run
from syncless.testing import spawn_gloo

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, MICRO_BATCHES, LAYERS = 3, 2, 2


def _config(run_dir: str, spmd_backend: str, compile: bool) -> Trainer.Config:
    return Trainer.Config(
        model_spec=model_spec("llama3"),
        tokenizer=NoTokenizer.Config(),
        dataloader=RandomTokens.Config(seed=1),
        loss=CrossEntropyLoss.Config(),
        optimizer=default_adamw(lr=1e-2),
        training=TrainingConfig(
            local_batch_size=1, global_batch_size=MICRO_BATCHES, seq_len=16, steps=STEPS,
            disable_cuda_graphs=True, mixed_precision_param="float32",
        ),
        parallelism=ParallelismConfig(spmd_backend=spmd_backend),
        compile=CompileConfig(enable=compile, backend="aot_eager"),
        activation_checkpoint=FullAC.Config(),
        metrics=SynclessMetricsProcessor.Config(
            run_dir=run_dir, monitors="gradients", budget=None
        ),
        debug=DebugConfig(seed=0),
        dump_folder=f"{run_dir}-dump",
    )  # fmt: skip


def _plain_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (checkpointing, compile)."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (full_dtensor's inputs) as the plain tensor it stands for."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _run_beside(trainer: Trainer) -> dict[int, dict]:
    """Each micro-batch of the trainer again in a plain copy, on the trainer's weights
    of the step; returns ``{step: truth}``, filled as the trainer runs."""
    model = trainer.model_parts[0]
    reference = build_model("llama3")
    truth = OutputGrads({int(key): block for key, block in reference.layers.items()})
    params = dict(reference.named_parameters())
    truths: dict[int, dict] = {}
    fwd_bwd = trainer.fwd_bwd_fn

    def beside(inputs, labels, global_valid_tokens, extra_kwargs):
        loss = fwd_bwd(inputs, labels, global_valid_tokens, extra_kwargs)
        with torch.no_grad():
            for name, p in model.named_parameters():
                params[_plain_name(name)].copy_(p.full_tensor())
        pred = reference(_plain(inputs), **extra_kwargs)
        trainer.loss_fn(pred, _plain(labels), _plain(global_valid_tokens))[0].backward()
        truths[trainer.step] = combine([truths.get(trainer.step, {}), truth.take()])
        return loss

    trainer.fwd_bwd_fn = beside
    return truths


def _flush_under_no_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    step = MonitorHandle.step

    def guarded(*args, **kwargs):
        with no_sync(cpu_as_device=True):
            return step(*args, **kwargs)

    monkeypatch.setattr(MonitorHandle, "step", guarded)


def _train(rank: int, world: int, run_dir: str, spmd_backend: str, compile: bool) -> dict:
    with pytest.MonkeyPatch.context() as monkeypatch:
        trainer_on_cpu(monkeypatch)
        _flush_under_no_sync(monkeypatch)
        trainer = Trainer(_config(run_dir, spmd_backend, compile))
        assert trainer.gradient_accumulation_steps == MICRO_BATCHES
        for block in trainer.model_parts[0].layers.values():  # parallelize_llama's work
            assert hasattr(block, "_checkpoint_wrapped_module")  # full AC
            assert (block._compiled_call_impl is not None) == compile  # in place
            assert all(isinstance(p, DTensor) for p in block.parameters())  # FSDP2
        truths = _run_beside(trainer)
        with guarded_gradient_callbacks() as calls:  # the processor attaches in train()
            trainer.train()
        trainer.close()
    return {"truths": truths, "calls": calls[0]}


@pytest.mark.parametrize(
    ("spmd_backend", "compile"),
    # full_dtensor with checkpointing and compile: aot_autograd saves a DeviceMesh for
    # the backward and asserts (torch 2.13, CPU, with or without syncless)
    [("spmd_types", True), ("full_dtensor", False)],
)
def test_the_trainer_records_the_gradient_at_each_block_output(spmd_backend, compile, tmp_path):
    run_dir = str(tmp_path / "run")
    out = spawn_gloo(_train, 1, run_dir, spmd_backend, compile, timeout_s=240)[0]
    # each layer's gradient read once per micro-batch (a gradient read twice, by a
    # checkpointing recompute say, would leave the RMS as it is)
    assert out["calls"] == STEPS * MICRO_BATCHES * LAYERS
    truths = out["truths"]
    assert sorted(truths) == list(range(1, STEPS + 1))
    with open_run(run_dir) as store:
        _, rows = store.query(
            "SELECT step, name, value FROM metrics WHERE name LIKE 'monitors/layer_%' "
            "OR name = 'monitors/self/errors_count'"
        )
    records: dict[int, dict[str, float]] = {}
    for step, name, value in rows:
        records.setdefault(step, {})[name] = value
    for step, truth in truths.items():
        assert truth[0].count == MICRO_BATCHES * 16 * 64
        assert_recorded(records[step], truth)
