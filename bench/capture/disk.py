"""The disk under the sink's directory, and the capture engine into it: the first two
measurements of bench/capture/load.py, and the disk rate bench/capture/soak.py offers
against.

1. **The disk.** Sequential writes of shard-sized files from pinned memory, timed until
   written (the page cache) and until on disk (``os.sync``), by one writer and by a
   pool. The synced rate is what the sink can sustain for hours; the page cache only
   absorbs bursts.
2. **The engine into that disk.** Records captured back to back (``on_full="block"``)
   into the default safetensors sink, timed until the sink has everything and until it
   is synced, against min(pinned D2H, disk).
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from bench.capture.drain import d2h_gbps
from syncless.capture import CaptureEngine, EngineConfig, SafetensorsSink

MiB = 1 << 20


def write_files(folder: Path, total: int, chunk: int, writers: int) -> tuple[float, float]:
    """Seconds to write ``total`` bytes as files of ``chunk`` bytes from one pinned
    buffer (``writers`` threads), then seconds until ``os.sync()`` returns."""
    data = torch.empty(chunk, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    data.fill_(7)
    view = memoryview(data.numpy())
    files = max(1, total // chunk)
    names = iter(range(files))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(names, None)
            if i is None:
                return
            with open(folder / f"f{i:05d}.bin", "wb") as f:
                f.write(view)

    with open(folder / "warmup.bin", "wb") as f:  # the first write of a process is slow
        f.write(view)
    os.sync()
    start = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    written = time.perf_counter() - start
    os.sync()
    synced = time.perf_counter() - start
    for p in folder.glob("*.bin"):
        p.unlink()
    return written, synced


def disk_rate(folder: Path, total: int, chunk: int, writers: int) -> tuple[float, float]:
    """GB/s of ``writers`` threads writing ``total`` bytes: into the page cache, synced."""
    written, synced = write_files(folder, total, chunk, writers)
    return total / written / 1e9, total / synced / 1e9


def engine_to_disk(
    folder: Path, ring: int, staging: int, record: int, total: int, writers: int
) -> tuple[float, float, dict[str, float]]:
    """GB/s of the engine into the safetensors sink: until stored, until synced."""
    sink = SafetensorsSink(folder)
    config = EngineConfig(writers=writers)
    engine = CaptureEngine(ring, staging, sink, on_full="block", config=config)
    x = torch.randn(record // 2, device=engine.device, dtype=torch.bfloat16)
    n = total // record
    os.sync()
    start = time.perf_counter()
    for i in range(n):
        engine.capture("x", x, step=i)
    engine.flush()
    stored = time.perf_counter() - start
    os.sync()
    synced = time.perf_counter() - start
    counters = engine.counters()
    engine.close()
    shutil.rmtree(folder / "captures", ignore_errors=True)
    nbytes = n * record
    return nbytes / stored / 1e9, nbytes / synced / 1e9, counters


def disk_stage(args: argparse.Namespace, device, folder: Path) -> str:
    """The disk, then the engine into it, for one writer and for the pool. The disk is
    measured right before and right after each engine run: a cloud volume's rate
    drifts (burst credits, the host's other tenants) over the tens of GB this writes,
    and the engine is judged against the disk of the same minutes."""
    total = int(args.disk_gb * 1e9)
    chunk = args.staging_mb * MiB // 2  # the writer's default shard
    pinned = d2h_gbps(device, args.staging_mb * MiB, pinned=True, reps=5)
    record = 32 * MiB if not args.tiny else MiB
    ring, staging = args.ring_mb * MiB, args.staging_mb * MiB
    parts = []
    for writers in (1, args.writers):
        before = disk_rate(folder, total, chunk, writers)
        stored, synced, _ = engine_to_disk(folder, ring, staging, record, total, writers)
        after = disk_rate(folder, total, chunk, writers)
        disk = (before[1] + after[1]) / 2
        parts.append(
            f"{writers} writer(s): disk {before[0]:.2f} / {after[0]:.2f} GB/s into the page "
            f"cache, {before[1]:.2f} / {after[1]:.2f} synced (before / after); engine "
            f"{stored:.2f} stored, {synced:.2f} synced = {synced / min(pinned, disk):.0%} of "
            f"min(D2H, synced disk)"
        )
    return (
        f"disk under {folder.parent} ({args.disk_gb:g} GB in {chunk // MiB} MiB files from "
        f"pinned memory; engine: {record // MiB} MiB records into the safetensors sink, ring "
        f"{args.ring_mb} MiB, staging {args.staging_mb} MiB); pinned D2H {pinned:.1f} GB/s; "
        + "; ".join(parts)
        + " (target >= 90%)"
    )
