"""syncless in torchtitan's Trainer, through the config route: the override swaps the
job's ``metrics`` component, and the processor attaches, flushes and closes as the
Trainer calls it.

The Trainer itself needs a CUDA-like device module on this CPU box, a tokenizer's files
and a dataset; what runs here is the real rest of it, in the Trainer's order: its
``Trainer.Config`` with ``--override.imports`` parsed from a CLI token and applied by
``apply_overrides``, ``parallelize_llama`` (full AC, per-block compile, FSDP2) on one
gloo rank, the optimizer container, ``config.metrics.build``, then ``train_step``'s
calls per step (zero_grad, ``should_log``, forward, backward, clip, step) and
``close``. Test shims: a stub device memory monitor (torchtitan's asks CUDA) and CPU
meshes (torchtitan's device type falls back to "cuda"). test_torchtitan_graphs.py runs
the whole Trainer, with more shims and without FSDP2.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

from syncless.run import open as open_run
from syncless.testing import spawn_gloo

STEPS, LAYERS = 3, 2  # torchtitan_harness's llama3 has 2 layers


def _rank(rank: int, world: int, run_dir: str) -> str:
    import json

    import torch
    import torchtitan.components.metrics as titan_metrics
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.trainer import Trainer
    from torchtitan_harness import NoDeviceMemory, model_spec

    from syncless.integrations.torchtitan import SynclessMetricsProcessor

    # test shims: torchtitan falls back to "cuda" on a machine without an accelerator
    titan_metrics.build_device_memory_monitor = NoDeviceMemory
    titan_dims.device_type = "cpu"  # the meshes' device
    settings = json.dumps({"run_dir": run_dir})
    token = f"syncless.integrations.torchtitan.syncless_metrics={settings}"  # a CLI token
    config = Trainer.Config(
        model_spec=model_spec("llama3"),
        training=TrainingConfig(local_batch_size=2, seq_len=16, steps=STEPS,
                                disable_cuda_graphs=True),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile=CompileConfig(enable=True, backend="aot_eager"),
        activation_checkpoint=FullAC.Config(),
        optimizer=default_adamw(lr=1e-3),
        override=OverrideConfig(imports=parse_cli_imports([token])),
    )  # fmt: skip
    apply_overrides(config.override, config)  # what Trainer.__init__ does
    assert isinstance(config.metrics, SynclessMetricsProcessor.Config)

    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    model = config.model_spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=config.training,
        parallelism=config.parallelism, compile_config=config.compile,
        ac_config=config.activation_checkpoint, dump_folder=run_dir,
    )  # fmt: skip
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    metrics = config.metrics.build(
        parallel_dims=parallel_dims, dump_folder=run_dir, config_dict=config.to_dict()
    )
    optimizers = config.optimizer.build(model_parts=[model])
    metrics.optimizers, metrics.model_parts = optimizers, [model]
    g = torch.Generator().manual_seed(rank)
    with torch._dynamo.config.patch(  # as torchtitan's apply_compile sets them
        capture_scalar_outputs=True, skip_fwd_side_effects_in_bwd_under_checkpoint=True
    ):
        for step in range(1, STEPS + 1):  # Trainer.train_step's calls, in its order
            optimizers.zero_grad()
            metrics.should_log(step)
            ids = torch.randint(0, 128, (2, 17), generator=g)
            pred = model(ids[:, :-1])
            torch.nn.functional.cross_entropy(pred.flatten(0, 1), ids[:, 1:].flatten()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizers.step()
    metrics.close()  # Trainer.close()
    assert metrics.session.handle.optimizer_steps == STEPS
    return str(metrics.session.run.dir)


@pytest.mark.dist
def test_the_override_route_records_every_layer_at_every_step(tmp_path) -> None:
    run_dir = str(tmp_path / "run")
    assert spawn_gloo(_rank, 1, run_dir, timeout_s=240) == [run_dir]
    with open_run(run_dir) as store:
        _, rows = store.query(
            "SELECT name, list(DISTINCT step ORDER BY step) FROM metrics "
            "WHERE name LIKE 'monitors/layer_%' OR name = 'monitors/self/flush_host_ms' "
            "GROUP BY name"
        )
    steps = dict(rows)
    # one flush per optimizer step, the last one at close; torchtitan's step numbers
    assert steps["monitors/self/flush_host_ms"] == [1, 2, 3]
    for layer in range(LAYERS):
        scope = f"monitors/layer_{layer:02d}"
        # step 1 at every monitor's fastest cadence (the budget may slow them after it)
        for name in ("attn_qk_logit_max", "act_absmax", "nonfinite_count", "param_norm"):
            assert steps[f"{scope}/{name}"][0] == 1, name
    assert not any(name.startswith(f"monitors/layer_{LAYERS:02d}") for name in steps)
