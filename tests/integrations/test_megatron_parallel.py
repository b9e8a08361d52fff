"""The monitors on Megatron-core under tensor, expert and pipeline parallelism, on 2
spawned gloo ranks (CPU, the test shim of tests/megatron_harness.py).

Each rank keeps its own ground truth with plain hooks (its heads' q and k recomputed
from the attention's projections with a rotate-half RoPE written in the test, its
router's routing map, its block outputs) and returns it; the test assembles the
cluster-wide values from those and compares them with what rank 0 recorded.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron_harness import (
    Parallel,
    batch,
    gpt_config,
    gpt_model,
    init_parallel,
)

from syncless.monitors import attach, build
from syncless.testing import spawn_gloo

pytestmark = pytest.mark.dist

SEQ = 16


def _truth_module():
    # The adapter tests' ground-truth hooks and naive attention (tests/monitors/adapters).
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "monitors/adapters/test_adapters_megatron.py"
    spec = importlib.util.spec_from_file_location("megatron_truth", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _plant_inf(block: torch.nn.Module) -> None:
    """Layer output element [0, 0, 0] becomes inf (a hook that runs before syncless's)."""

    def hook(module, args, output):
        hidden = output[0].clone()
        hidden[0, 0, 0] = torch.inf
        return (hidden, *output[1:])

    block.register_forward_hook(hook)


def _run_rank(rank: int, world: int, case: str) -> dict[str, Any]:
    truth_lib = _truth_module()
    parallel = {
        "tp2": Parallel(tp=2),
        "tp2-sp-moe": Parallel(tp=2),
        "ep2": Parallel(ep=2),
    }[case]
    init_parallel(parallel)
    experts = None if case == "tp2" else 4
    config = gpt_config(layers=2, heads=4, query_groups=2, experts=experts, parallel=parallel)
    torch.manual_seed(0)  # the same replicated weights on every rank
    model = gpt_model(config)
    if case == "tp2":
        _plant_inf(model.decoder.layers[1])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    truth = truth_lib.Truth(model)
    handle = attach(model, build("all", optimizer=opt), lagged=False, budget=None)
    # Tensor-parallel ranks share their input; expert-parallel ranks are data-parallel.
    seed = 7 if case.startswith("tp") else 7 + rank
    tokens, positions, labels, mask = batch(seed, seq=SEQ)
    loss = model(tokens, positions, mask, labels=labels)
    loss.float().mean().backward()
    # Before the step: the planted inf makes every gradient NaN, and 0 * NaN is NaN.
    squares = _squares(model)
    opt.step()
    records = {r.name: r.value for r in handle.step(0)}
    readout = handle.readouts[-1]
    handle.close()
    out: dict[str, Any] = {"records": records, "heads": {}, "counts": {}, "absmax": {}}
    out.update(squares)
    for layer in range(2):
        q, k = truth.qk[layer]
        out["heads"][layer] = truth_lib.naive_attention(q, k, scale=0.25)
        hidden = truth.outputs[layer]
        finite = torch.where(hidden.isfinite(), hidden, 0.0)
        out["absmax"][layer] = finite.abs().reshape(-1, hidden.shape[-1]).amax(0).numpy()
        for name in ("attn_qk_logit_max", "attn_entropy_nats", "moe_tokens_count"):
            key = f"monitors/layer_{layer:02d}/{name}"
            if key in readout.values:
                out[key] = readout.get(key)
        if layer in truth.routing:
            out["counts"][layer] = truth.routing[layer][1].sum(0).double().numpy()
    return out


def _squares(model: torch.nn.Module) -> dict[str, dict[int, float]]:
    """Per layer: the sum of squares of all its parameters, of the replicated ones
    (not tensor-parallel) and of the experts', on this rank."""

    def total(block: torch.nn.Module, keep) -> float:
        return float(sum(p.detach().double().square().sum() for p in block.parameters() if keep(p)))

    blocks = list(model.decoder.layers)
    return {
        "sq": {i: total(b, lambda p: True) for i, b in enumerate(blocks)},
        "replicated_sq": {
            i: total(b, lambda p: not getattr(p, "tensor_model_parallel", False))
            for i, b in enumerate(blocks)
        },
        "expert_sq": {
            i: total(b, lambda p: getattr(p, "allreduce", True) is False)
            for i, b in enumerate(blocks)
        },
    }


def test_tensor_parallel_heads_are_recorded_under_their_global_index():
    ranks = spawn_gloo(_run_rank, 2, "tp2", timeout_s=180)
    zero = ranks[0]
    for layer in range(2):
        key = f"monitors/layer_{layer:02d}"
        # Rank r holds heads 2r, 2r+1 of 4 (and kv group r of 2).
        top = np.concatenate([ranks[r]["heads"][layer][0] for r in range(2)])
        entropy = np.concatenate([ranks[r]["heads"][layer][1] for r in range(2)])
        np.testing.assert_allclose(zero[f"{key}/attn_qk_logit_max"], top, rtol=1e-5)
        np.testing.assert_allclose(zero[f"{key}/attn_entropy_nats"], entropy, rtol=1e-5)
        # Without sequence parallelism both ranks hold the same output: counted once.
        assert zero["records"][f"{key}/nonfinite_count"] == (1 if layer == 1 else 0)
        np.testing.assert_allclose(ranks[1]["absmax"][layer], ranks[0]["absmax"][layer])
    # Norms: tensor-parallel weights add their shards, the replicated norms count once.
    for layer in range(2):
        got = zero["records"][f"monitors/layer_{layer:02d}/param_norm"]
        assert got**2 == pytest.approx(_tp_norm_sq(ranks, layer), rel=1e-6)


def _tp_norm_sq(ranks: list[dict[str, Any]], layer: int) -> float:
    """The full layer's sum of squares: the sharded parts of both ranks plus the
    replicated ones once (the layernorm weights are the same on both ranks)."""
    return sum(r["sq"][layer] for r in ranks) - ranks[1]["replicated_sq"][layer]


def test_moe_under_tensor_and_sequence_parallelism_counts_every_rank_s_tokens():
    ranks = spawn_gloo(_run_rank, 2, "tp2-sp-moe", timeout_s=180)
    for layer in range(2):
        counts = ranks[0]["counts"][layer] + ranks[1]["counts"][layer]
        assert counts.sum() == 2 * SEQ * 2  # the sequence is split: each token once
        np.testing.assert_array_equal(
            ranks[0][f"monitors/layer_{layer:02d}/moe_tokens_count"], counts
        )


def test_expert_parallel_counts_and_norms_sum_over_the_ranks():
    ranks = spawn_gloo(_run_rank, 2, "ep2", timeout_s=180)
    zero = ranks[0]
    for layer in range(2):
        key = f"monitors/layer_{layer:02d}"
        counts = ranks[0]["counts"][layer] + ranks[1]["counts"][layer]
        assert counts.sum() == 2 * (2 * SEQ * 2)  # two data-parallel batches
        np.testing.assert_array_equal(zero[f"{key}/moe_tokens_count"], counts)
        imbalance = counts.max() / counts.mean()
        assert zero["records"][f"{key}/moe_imbalance"] == pytest.approx(imbalance)
        # Each rank holds 2 of the 4 experts; everything else is replicated.
        shared = zero["sq"][layer] - zero["expert_sq"][layer]
        want = shared + ranks[0]["expert_sq"][layer] + ranks[1]["expert_sq"][layer]
        assert zero["records"][f"{key}/param_norm"] ** 2 == pytest.approx(want, rel=1e-6)


class DistributedOptimizerLike:
    """What megatron-core 0.16's ``DistributedOptimizer`` keeps, on the CPU (the real one
    refuses tensors that are not ``torch.cuda.*Tensor``): per model parameter an fp32
    shard of its flattened elements, this data-parallel rank's slice, which a torch
    optimizer steps; gradients copied into the shards before the step, as Megatron does
    after its reduce-scatter (here an all-reduce, then the slice)."""

    def __init__(self, params: list[torch.nn.Parameter], dp_rank: int, dp_size: int) -> None:
        self.model_float16_groups: list[list] = [[]]
        self.shard_fp32_from_float16_groups: list[list] = [[]]
        self.model_fp32_groups = [list(params)]
        self.ranges = []
        shards = []
        for p in params:
            n = p.numel()
            start, end = n * dp_rank // dp_size, n * (dp_rank + 1) // dp_size
            self.ranges.append((start, end))
            shards.append(p.detach().view(-1)[start:end].clone().float().requires_grad_())
        self.shard_fp32_groups = [shards]
        self.optimizer = torch.optim.SGD(shards, lr=0.0)

    def step(self) -> None:
        for p, shard, (start, end) in zip(
            self.model_fp32_groups[0], self.shard_fp32_groups[0], self.ranges, strict=True
        ):
            shard.grad = p.grad.view(-1)[start:end].float()
        self.optimizer.step()


def _run_distributed_optimizer(rank: int, world: int, case: str, run_dir: str) -> dict[str, Any]:
    from megatron.core import parallel_state

    from syncless.integrations.megatron import SynclessMegatron
    from syncless.run import Run

    parallel = Parallel(tp=2) if case == "tp2" else Parallel()
    init_parallel(parallel)
    torch.manual_seed(0)
    model = gpt_model(gpt_config(layers=2, heads=4, query_groups=2, parallel=parallel))
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    optimizer = DistributedOptimizerLike(list(model.parameters()), dp_rank, dp_size)
    run = Run(run_dir=run_dir)
    syncless = SynclessMegatron(model, optimizer, monitors="norms", budget=None, run=run)
    tokens, positions, labels, mask = batch(11 + dp_rank, seq=SEQ)
    model(tokens, positions, mask, labels=labels).float().mean().backward()
    for p in model.parameters():  # the data-parallel gradient average
        dist.all_reduce(p.grad, group=parallel_state.get_data_parallel_group())
        p.grad /= dp_size
    squares = _squares(model)
    grad_sq = {
        i: float(sum(p.grad.double().square().sum() for p in b.parameters()))
        for i, b in enumerate(model.decoder.layers)
    }
    replicated_grad_sq = {
        i: float(
            sum(
                p.grad.double().square().sum()
                for p in b.parameters()
                if not getattr(p, "tensor_model_parallel", False)
            )
        )
        for i, b in enumerate(model.decoder.layers)
    }
    syncless.optimizer_step(optimizer)
    syncless.step(0)
    syncless.close()
    records = {r.name: r.value for r in syncless.handle.last_records}
    syncless.run.close()
    return {**squares, "grad_sq": grad_sq, "replicated_grad_sq": replicated_grad_sq,
            "records": records}  # fmt: skip


@pytest.mark.parametrize("case", ["dp2", "tp2"])
def test_norms_of_the_full_parameters_from_distributed_optimizer_shards(case, tmp_path):
    ranks = spawn_gloo(_run_distributed_optimizer, 2, case, str(tmp_path / "run"), timeout_s=180)
    zero = ranks[0]
    for layer in range(2):
        key = f"monitors/layer_{layer:02d}"
        if case == "dp2":  # both ranks hold the whole model; the shards split it
            param_sq, grad_sq = zero["sq"][layer], zero["grad_sq"][layer]
        else:  # tensor-parallel parts add up, the replicated ones count once
            param_sq = _tp_norm_sq(ranks, layer)
            grad_sq = (
                sum(r["grad_sq"][layer] for r in ranks) - ranks[1]["replicated_grad_sq"][layer]
            )
        assert zero["records"][f"{key}/param_norm"] ** 2 == pytest.approx(param_sq, rel=1e-6)
        assert zero["records"][f"{key}/grad_norm"] ** 2 == pytest.approx(grad_sq, rel=1e-6)


def test_the_attributes_read_are_megatron_s_own():
    """The names main_param_copies reads are the ones megatron-core's optimizers set."""
    import inspect

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    source = inspect.getsource(DistributedOptimizer)
    for name in ("model_float16_groups", "shard_fp32_from_float16_groups",
                 "model_fp32_groups", "shard_fp32_groups"):  # fmt: skip
        assert f"self.{name} = " in source or f"self.{name}," in source, name
    source = inspect.getsource(Float16OptimizerWithFloat16Params)
    for name in ("float16_groups", "fp32_from_float16_groups"):
        assert f"self.{name}" in source, name
