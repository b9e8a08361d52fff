"""Who this process is in a (possibly distributed) job."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_info() -> RankInfo:
    """Rank, world size and local rank from torch.distributed, else torchrun's env vars."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size(), local_rank)
    return RankInfo(
        int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), local_rank
    )


def gpu_label(index: int) -> str:
    """CUDA device ``index`` as ``cuda:<index> <PCI bus id>``, the id nvidia-smi and
    NVML print (``cuda:3 0000:3b:00.0``); ``cuda:<index>`` where torch lacks it."""
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return f"cuda:{index}"
    domain, slot = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
    return f"cuda:{index} {domain:04x}:{bus:02x}:{slot:02x}.0"
