"""Process group setup and gradient synchronisation for the demo.

Data parallel: every rank holds the dense weights and averages their gradients with
one all_reduce over a flat buffer per step. Expert parallel: experts are sharded,
their gradients already sum every rank's tokens through the all_to_all backward, so
they are only divided by the world size (the global loss is the mean of the ranks'
losses).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from syncless.run import RankInfo, rank_info


def ranks_per_gpu(local_ranks: int | None = None) -> int:
    """How many of this machine's ranks (``local_ranks``, else torchrun's
    LOCAL_WORLD_SIZE) share each GPU: 1 unless they are more than the GPUs torch sees
    (then local rank r runs on GPU ``r % count``)."""
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return -(-local_ranks // max(torch.cuda.device_count(), 1))


def backend_for(device_type: str) -> str:
    """NCCL with a GPU per rank; gloo on CPU and for ranks that share a GPU.

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); gloo takes CUDA
    tensors (through copies to the host, which wait for the GPU), so `--nproc 2` runs
    on a one-GPU machine: every multi-rank code path on CUDA, at no meaningful speed.
    """
    if device_type == "cuda" and ranks_per_gpu() == 1:
        return "nccl"
    return "gloo"


def init_distributed(device_type: str) -> RankInfo:
    """Join the torchrun job if there is one (backend: :func:`backend_for`)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group(backend_for(device_type), timeout=timedelta(minutes=5))
    return rank_info()


def is_expert_param(name: str) -> bool:
    return ".experts." in name


def split_grads(
    model: nn.Module, expert_parallel: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(replicated gradients, expert-sharded gradients); no experts are sharded
    without expert parallelism."""
    dense, sharded = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            (sharded if expert_parallel and is_expert_param(name) else dense).append(p.grad)
    return dense, sharded


def sync_gradients(
    model: nn.Module, expert_parallel: bool, also: Sequence[torch.Tensor] = ()
) -> None:
    """Average dense gradients across ranks; rescale sharded expert gradients.

    ``also``: tensors averaged in place in the same all_reduce (the routers'
    expert loads, ``model.ExpertBalancer.loads``): no collective of their own.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    world = dist.get_world_size()
    dense, sharded = split_grads(model, expert_parallel)
    averaged = dense + list(also)
    if averaged:
        flat = torch.cat([t.reshape(-1) for t in averaged])
        dist.all_reduce(flat)
        flat.div_(world)
        for t, synced in zip(averaged, flat.split([t.numel() for t in averaged]), strict=True):
            t.copy_(synced.view_as(t))
    if sharded:
        torch._foreach_div_(sharded, world)


def clip_grad_norm(model: nn.Module, max_norm: float, expert_parallel: bool) -> torch.Tensor:
    """Clip by the global gradient norm without reading it back to the host.

    Under expert parallelism each rank holds different expert gradients, so their
    squared norms are summed across ranks (one scalar all_reduce).
    """
    dense, sharded = split_grads(model, expert_parallel)
    device = next(model.parameters()).device
    sq = torch.zeros((), device=device)
    if dense:
        sq = sq + torch.stack(torch._foreach_norm(dense)).square().sum()
    if sharded:
        sharded_sq = torch.stack(torch._foreach_norm(sharded)).square().sum()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sharded_sq)
        sq = sq + sharded_sq
    norm = sq.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(dense + sharded, scale)
    return norm
