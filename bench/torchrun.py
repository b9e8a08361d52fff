"""Relaunch a benchmark script on N local ranks under torchrun, as ``--worker``s."""

from __future__ import annotations

import subprocess
import sys

from syncless.demo.launch import strip_nproc


def relaunch(script: str, nproc: int, *extra: str) -> int:
    """Run ``script --worker <this command's arguments> <extra>`` on ``nproc`` ranks.

    ``--nproc`` is not forwarded: torchrun reads it as an abbreviation of its own
    ``--nproc-per-node``, even after the script name.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", script, "--worker", *strip_nproc(sys.argv[1:]), *extra]  # fmt: skip
    return subprocess.call(cmd)
