"""Where each rank of a run ran: ``ranks/rankNNNNN.json``, one small file per rank.

A straggler verdict names a rank; the on-call engineer acts on a node and a GPU. Each
rank's :class:`~syncless.run.Run` writes its own file once, when it opens: a write per
rank, no gather, nothing on the step's path. A resumed run's start writes it again
(a job restarted on other nodes: the latest place is the one to act on).
``syncless stragglers`` reads the files of the ranks it names only.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from syncless.run.storage import RunPath, run_path, write_whole

if TYPE_CHECKING:
    from syncless.run.dist import RankInfo

# No torch at import: `syncless stragglers` reads placements in a fresh process that
# imports DuckDB only (tests/run/test_cli_startup.py).

__all__ = ["RANKS_DIR", "Placement", "read_placement", "write_placement"]

RANKS_DIR = "ranks"


@dataclass(frozen=True)
class Placement:
    """One rank's host, local rank, process and GPU."""

    rank: int
    host: str
    local_rank: int
    pid: int
    gpu: str = ""  # gpu_label(): "" where CUDA was not initialized when the run opened

    def describe(self) -> str:
        """``node-07 local rank 3 cuda:3 0000:3b:00.0``."""
        gpu = f" {self.gpu}" if self.gpu else ""
        return f"{self.host} local rank {self.local_rank}{gpu}"


def here(info: RankInfo) -> Placement:
    """This process's placement. Its GPU only where CUDA is initialized already: a
    run opened before the model moved to the GPU must not create a CUDA context."""
    import torch

    from syncless.run.dist import location

    host, gpu = location(torch.cuda.is_initialized())
    return Placement(info.rank, host, info.local_rank, os.getpid(), gpu)


def write_placement(run_dir: RunPath, placement: Placement) -> None:
    """Write ``placement`` into the run (whole: a rename, or one PUT)."""
    folder = run_dir / RANKS_DIR
    if not hasattr(folder, "fs"):  # a local path; an object store has no folders
        folder.mkdir(exist_ok=True)
    data = (json.dumps(asdict(placement)) + "\n").encode()
    write_whole(folder / f"rank{placement.rank:05d}.json", data)


def read_placement(run_dir: str | os.PathLike | RunPath, rank: int) -> Placement | None:
    """Rank ``rank``'s placement, or None (a run from before placements, or a rank
    that never opened its run)."""
    path = run_path(run_dir) / RANKS_DIR / f"rank{rank:05d}.json"
    try:
        doc = json.loads(path.read_text())
        return Placement(**doc)
    except (OSError, ValueError, TypeError):
        return None
