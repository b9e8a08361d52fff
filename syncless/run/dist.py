"""Who this process is in a (possibly distributed) job."""

from __future__ import annotations

import os
import socket
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


def location(cuda: bool) -> tuple[str, str]:
    """(host name, GPU) of this process. The GPU is the current CUDA device as
    ``cuda:<index> <PCI bus id>``, the id nvidia-smi and NVML print
    (``cuda:3 0000:3b:00.0``), ``cuda:<index>`` where torch lacks the bus id, and ""
    without ``cuda`` or where torch cannot say: a label never fails its caller."""
    host = socket.gethostname()
    if not cuda:
        return host, ""
    try:
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
    except Exception:
        return host, ""
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return host, f"cuda:{index}"
    domain, slot = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
    return host, f"cuda:{index} {domain:04x}:{bus:02x}:{slot:02x}.0"
