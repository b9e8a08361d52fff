"""A per-step trace of MoE routing ids, written to the run directory.

Costly by design (trace a few steps, then turn it off): every traced router's expert
ids, ``[tokens, top_k]`` per layer per step, are copied device-to-host without a sync
(non-blocking into pinned, double-buffered memory) and written one step later as
``trace/routing/rank<RRRRR>/step_<SSSSSSS>.npz`` with one array per layer
(``layer_03``), once the copy's event has completed.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from syncless.hot_path import hot_path
from syncless.run.atomic import replaced_when_written


class RoutingTrace:
    def __init__(self, run_dir: str | os.PathLike, rank: int) -> None:
        self.dir = Path(run_dir) / "trace" / "routing" / f"rank{rank:05d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        # (layer, parity) -> pinned host tensor and its numpy view (made once, so the
        # write reads plain host memory, not a torch call a sync detector must judge)
        self._buffers: dict[tuple[int, int], tuple[torch.Tensor, np.ndarray]] = {}
        self._step_layers: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
        self._parity = 0
        self._pending: tuple[int, dict, object] | None = None
        self.files_written = 0

    @hot_path
    def record(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Queue this step's ids of ``layer`` for the host (no sync)."""
        key = (layer, self._parity)
        entry = self._buffers.get(key)
        if entry is None or entry[0].shape != expert_ids.shape:
            # First use of this layer (or a new token count): a pinned allocation, once.
            host = torch.empty(
                expert_ids.shape, dtype=expert_ids.dtype, pin_memory=expert_ids.is_cuda
            )
            entry = self._buffers[key] = (host, host.numpy())  # syncless: ok view of a host buffer
        entry[0].copy_(expert_ids, non_blocking=expert_ids.is_cuda)
        self._step_layers[layer] = entry

    def end_step(self, step: int) -> None:
        """Close ``step``: write the previous traced step, queue this one."""
        event = None
        if torch.cuda.is_available() and any(t.is_pinned() for t, _ in self._step_layers.values()):
            event = torch.cuda.Event()
            event.record()
        previous, self._pending = self._pending, (step, self._step_layers, event)
        self._step_layers = {}
        self._parity ^= 1
        if previous is not None:
            self._write(previous)

    def close(self) -> None:
        if self._pending is not None:
            self._write(self._pending)
            self._pending = None

    def _write(
        self, pending: tuple[int, dict[int, tuple[torch.Tensor, np.ndarray]], object]
    ) -> None:
        step, layers, event = pending
        if not layers:
            return
        if event is not None:
            event.synchronize()  # a step later: long complete
        arrays = {f"layer_{layer:02d}": a.copy() for layer, (_, a) in sorted(layers.items())}
        with replaced_when_written(self.dir / f"step_{step:07d}.npz") as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)
        self.files_written += 1
