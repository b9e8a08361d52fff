"""``syncless demo --nproc N``: the same demo under torchrun, on this machine."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Sequence


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def launch(nproc: int, demo_argv: Sequence[str]) -> int:
    """Run ``syncless demo <demo_argv>`` on ``nproc`` local ranks; return the exit code.

    torchrun (torch.distributed.run) rather than a hand-rolled spawn: it is what users
    run in production, it sets RANK/WORLD_SIZE/LOCAL_RANK and tears every rank down
    when one fails.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        "--rdzv-backend=c10d",
        "-m",
        "syncless.cli",
        "demo",
        *demo_argv,
    ]
    return subprocess.call(cmd)
