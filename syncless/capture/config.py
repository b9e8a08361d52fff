"""What a capture engine is built from: its tuning (:class:`EngineConfig`), its
backpressure policy, its device and its sink, each checked with an error that says
what was expected."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from syncless.capture.sinks.fsspec import FsspecSink
from syncless.capture.sinks.shards import CAPTURES_DIR, CaptureSink, SafetensorsSink
from syncless.run.storage import is_remote

if TYPE_CHECKING:
    from syncless.run import Run

__all__ = ["EngineConfig", "OnFull", "check_on_full", "resolve_device", "resolve_sink"]

OnFull = Literal["drop", "block", "flush"]
_ON_FULL = ("drop", "block", "flush")


def positive_int(value: Any, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def positive_float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what} must be a number > 0, got {value!r}")
    return float(value)


def check_on_full(value: Any) -> OnFull:
    if value not in _ON_FULL:
        raise ValueError(
            f"on_full={value!r}: expected one of {', '.join(map(repr, _ON_FULL))} (drop: "
            f"count it and go on; block: wait for the drain to free space; flush: drain "
            f"everything ready now, then capture)"
        )
    return value


@dataclass(frozen=True)
class EngineConfig:
    """Tuning of the capture engine; the defaults suit a training step of milliseconds.

    Args:
        max_records: record slots, i.e. records in the ring at most (each slot has a
            preallocated CUDA event).
        align: alignment of every record in both rings, in bytes (a power of two >= 16,
            so any dtype can be viewed in place; larger values help copy speed).
        boundary_pool: boundaries whose device stamps are kept; a window whose OPEN or
            CLOSE is this many boundaries old when the drain looks is not measured.
        poll_interval_s: how often an idle drain looks at the ring and the boundary
            word where nothing wakes it: windows the drain observes (the CPU), and an
            inline drain (``background=False``). A batching or planned drain thread
            sleeps until woken instead.
        late_issue_s: a window transfer that starts later than this after the OPEN (on
            the device timeline) was issued late: the controller learns nothing from it.
        shard_bytes: the writer writes a shard once this many bytes are waiting
            (default: the staging ring over ``writers + 1``, so every writer can be busy
            with a shard while the drain fills the next).
        shard_interval_s: ... or once the oldest waiting batch is this old.
        gather_bytes: a batching drain is woken once this many bytes wait in the ring
            (default a quarter of it) or half the record slots are taken ...
        gather_interval_s: ... or looks this long after the first record it has not
            taken. Captures in between pile up and go in one transfer, so the drain's
            Python (which holds the GIL) runs per transfer, not per capture. Rare looks
            matter on a GPU-bound step: with every layer of Llama-1B captured (1 GiB
            and 256 small deferred captures a step, 4 GiB ring), a look every 204 MiB
            or 20 ms and every 64 deferred captures cost the step +0.91% to +1.51%
            (seven runs), these defaults +0.29%, +0.00%, +0.66% and +0.26% (four), against
            +0.04% to +0.27% for the same copies made with torch and no engine
            (docs/capture.md, "The drain gathers").
        writers: shards the sink writes at once, each on a thread of its own (a sink
            with ``concurrent_writes = False`` gets one). Several files in flight use
            the page cache's and the drive's parallelism or an object store's parallel
            uploads: on the H200 host, 512 MiB files from pinned memory went into the
            page cache at 2.44 GB/s from one thread and 12.8 GB/s from four, and to
            disk (synced) at 1.12 and 1.75 GB/s (bench/capture/load.py, 0a153bf).
        planned_windows: windows copies planned by the drain and launched by
            ``advance_boundary()`` at the OPEN (None, the default: on CUDA, where a
            drain thread that reacts to the OPEN starts late on a host-bound step); on
            the CPU the launch is the copy itself, inside ``advance_boundary()``.
        defer_copy_below: captures of fewer bytes leave their copy into the ring to
            the drain, which enqueues it on the same stream at its next look (within
            ``gather_interval_s``): the training thread then makes
            no driver call. The tensor must stay unchanged until then. 0, the default,
            defers none: whether that holds is the caller's to know (docs/capture.md,
            "Deferred copies"); ``capture(defer=...)`` decides per call.
    """

    max_records: int = 4096
    align: int = 64
    boundary_pool: int = 1024
    poll_interval_s: float = 2e-4
    late_issue_s: float = 5e-4
    shard_bytes: int | None = None
    shard_interval_s: float = 5.0
    gather_bytes: int | None = None
    gather_interval_s: float = 0.05
    writers: int = 4
    planned_windows: bool | None = None
    defer_copy_below: int = 0

    def __post_init__(self) -> None:
        positive_int(self.max_records, "EngineConfig.max_records")
        positive_int(self.align, "EngineConfig.align", 16)
        if self.align & (self.align - 1):
            raise ValueError(f"EngineConfig.align must be a power of two, got {self.align}")
        positive_int(self.boundary_pool, "EngineConfig.boundary_pool", 2)
        positive_float(self.poll_interval_s, "EngineConfig.poll_interval_s")
        positive_float(self.late_issue_s, "EngineConfig.late_issue_s")
        if self.shard_bytes is not None:
            positive_int(self.shard_bytes, "EngineConfig.shard_bytes")
        positive_float(self.shard_interval_s, "EngineConfig.shard_interval_s")
        if self.gather_bytes is not None:
            positive_int(self.gather_bytes, "EngineConfig.gather_bytes")
        positive_float(self.gather_interval_s, "EngineConfig.gather_interval_s")
        positive_int(self.writers, "EngineConfig.writers")
        positive_int(self.defer_copy_below, "EngineConfig.defer_copy_below", 0)


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"CaptureEngine: device={device!r} is not a torch device") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"CaptureEngine: device={device} but CUDA is not available")
        if device.index is None:  # compare equal to the tensors' devices, which are indexed
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(
            f"CaptureEngine: device={device}: expected a CUDA device or the CPU (copies to "
            f"the host are CUDA copies, or synchronous copies on the CPU)"
        )
    return device


def resolve_sink(
    sink: CaptureSink | str | os.PathLike[str] | None, run: Run | None, rank: int
) -> CaptureSink:
    if sink is None:
        if run is None:
            raise ValueError(
                "CaptureEngine: no sink: pass a CaptureSink, a run directory, or run=Run(...)"
            )
        if is_remote(run.dir):  # a run in an object store keeps its captures there too
            options = getattr(run.dir, "storage_options", None)
            return FsspecSink(f"{run.dir}/{CAPTURES_DIR}", rank, storage_options=options)
        return SafetensorsSink(run.dir, rank)
    if isinstance(sink, (str, os.PathLike)):
        return SafetensorsSink(sink, rank)
    if not isinstance(sink, CaptureSink):
        raise ValueError(
            f"CaptureEngine: sink must be a CaptureSink (write(records), close()) or a run "
            f"directory, got {type(sink).__name__}"
        )
    return sink
