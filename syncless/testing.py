"""Test helpers: run a function on several real gloo ranks on 127.0.0.1."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any


def _worker(fn: Callable, rank: int, world: int, store: str, args: tuple, results) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        try:
            # Pickled here, in-band: a tensor put on the queue as is travels as a shared
            # file descriptor, which is gone if this process exits before the parent reads.
            results.put((rank, True, pickle.dumps(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def spawn_gloo(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    Each process joins a gloo group on 127.0.0.1 first. Returns the ranks' return
    values in rank order; raises AssertionError with the remote traceback if any rank
    fails. ``fn`` and its results must be picklable (define ``fn`` at module level).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The ranks meet through a file, not a TCP port picked here: a port found free and
    # closed again can be taken by any other process before the ranks bind it (the
    # race of tests/demo/test_stop.py). gloo then binds its own ports, held from the start.
    folder = tempfile.TemporaryDirectory(prefix="syncless-gloo-")
    store = str(Path(folder.name) / "store")
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, store, args, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    failures = []
    try:
        for _ in procs:
            rank, ok, value = results.get(timeout=timeout_s)
            if ok:
                out[rank] = pickle.loads(value)
            else:
                failures.append(f"rank {rank}:\n{value}")
                break  # the other ranks may now hang in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if failures else timeout_s)
            if p.is_alive():
                p.kill()
                p.join()
        folder.cleanup()
    if failures:
        raise AssertionError("a spawned rank failed\n" + "\n".join(failures))
    return [out[r] for r in range(world_size)]
