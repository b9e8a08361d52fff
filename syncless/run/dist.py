"""Who this process is in a (possibly distributed) job."""

from __future__ import annotations

import os
from dataclasses import dataclass

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
