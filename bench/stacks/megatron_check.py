"""On a GPU, two checks of syncless inside Megatron-core that the CPU tests cannot make:

1. the attention monitor's Triton kernel on Megatron's q/k (views of ``[s, b, heads,
   d]`` tensors, permuted) against a float64 softmax of the same tensors (the kernel
   only runs on CUDA);
2. the norms under Megatron's real ``DistributedOptimizer`` (it refuses CPU tensors):
   ``param_norm`` and ``grad_norm`` per layer against the model's own bf16 parameters
   and ``main_grad`` buffers.

    python -m bench.stacks megatron_check
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from bench.stacks.stack_models import MEGATRON, build_megatron
from syncless.monitors import attach, build
from syncless.monitors.adapters import find_layers


def naive(q: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) * scale
    allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    logits = logits.masked_fill(~allowed, -torch.inf)
    p = logits.softmax(-1)
    entropy = -torch.where(allowed, p * p.clamp_min(1e-300).log(), 0.0).sum(-1)
    return logits.amax(dim=(0, 2, 3)), entropy.mean(dim=(0, 2))


def check_attention() -> None:
    spec = replace(MEGATRON, layers=2, batch=2, seq_len=1024)
    work = build_megatron(spec, torch.device("cuda"))
    captured = {}
    handles = []
    for site in find_layers(work.model).attention:
        handles += site.attach_qk(lambda q, k, i=site.layer: captured.__setitem__(i, (q, k)))
    handle = attach(work.model, build("attention"), lagged=False, budget=None)
    with torch.no_grad():
        work.loss()
    records = handle.step(0)
    readout = handle.readouts[-1]
    handle.close()
    for h in handles:
        h.remove()
    scale = find_layers(work.model).attention[0].scale
    worst = 0.0
    for layer, (q, k) in captured.items():
        top, entropy = naive(q, k, scale)
        got_top = torch.as_tensor(readout.get(f"monitors/layer_{layer:02d}/attn_qk_logit_max"))
        got_ent = torch.as_tensor(readout.get(f"monitors/layer_{layer:02d}/attn_entropy_nats"))
        err = max(
            float(((got_top - top.cpu()).abs() / top.cpu().abs()).max()),
            float(((got_ent - entropy.cpu()).abs() / entropy.cpu().abs()).max()),
        )
        worst = max(worst, err)
        print(f"layer {layer}: q {tuple(q.shape)} strides {q.stride()}, max rel err {err:.2e}")
    print(f"records {len(records)}; worst relative error {worst:.2e} (bf16 q/k, fp32 kernel)")
    assert worst < 2e-2, worst


def check_distributed_optimizer() -> None:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from syncless.integrations.megatron import SynclessMegatron

    spec = replace(MEGATRON, layers=2, batch=2, seq_len=512, experts=0, top_k=0)
    work = build_megatron(spec, torch.device("cuda"))
    gpt = work.model.module  # under Float16Module
    ddp = DistributedDataParallel(
        config=gpt.config,
        ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True
        ),
        module=work.model,
    )
    optimizer = get_megatron_optimizer(
        # No clipping: the monitor reads gradients as the inner optimizer gets them,
        # after Megatron's clip (its default clip_grad=1.0 scaled them by 0.27 here).
        OptimizerConfig(
            optimizer="adam", lr=0.0, bf16=True, use_distributed_optimizer=True, clip_grad=0.0
        ),
        [ddp],
    )
    print(f"optimizer: {type(optimizer).__name__}")
    syncless = SynclessMegatron([ddp], optimizer, monitors="norms", budget=None)
    ddp.zero_grad_buffer()
    work.loss().backward()
    gpt.config.finalize_model_grads_func = finalize_model_grads
    finalize_model_grads([ddp])
    want = {}
    for i, block in enumerate(gpt.decoder.layers):
        params = list(block.parameters())
        want[i] = (
            float(sum(p.detach().double().square().sum() for p in params)) ** 0.5,
            float(sum(p.main_grad.double().square().sum() for p in params)) ** 0.5,
        )
    syncless.optimizer_step(optimizer)
    syncless.step(0)
    syncless.close()
    got = {r.name: r.value for r in syncless.handle.last_records}
    for i, (param, grad) in want.items():
        key = f"monitors/layer_{i:02d}"
        p_err = abs(got[f"{key}/param_norm"] / param - 1)
        g_err = abs(got[f"{key}/grad_norm"] / grad - 1)
        print(f"layer {i}: param_norm {got[f'{key}/param_norm']:.6g} vs {param:.6g} "
              f"({p_err:.1e}), grad_norm {got[f'{key}/grad_norm']:.6g} vs {grad:.6g} "
              f"({g_err:.1e})")  # fmt: skip
        assert p_err < 1e-5 and g_err < 1e-5, (p_err, g_err)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    check_attention()
    check_distributed_optimizer()
