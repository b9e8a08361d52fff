"""Small int64 tables on the device, refreshed every step without a sync.

A grouped kernel finds layer ``l``'s tensor at ``offsets[l]`` elements from layer 0's,
and those addresses change every step. Building the table with ``torch.tensor(...,
device="cuda")`` would copy from pageable memory, which synchronizes. Here a table is
written into one of a few preallocated pinned buffers and copied with one
non-blocking copy; a pinned buffer is rewritten only once its last copy has completed
(an event query, no wait), and when none is free ``upload`` returns ``None`` so the
caller takes its per-layer path.
"""

from __future__ import annotations

import torch

from syncless.hot_path import hot_path


class OffsetRing:
    """``slots`` pinned host buffers and device buffers of ``size`` int64 each."""

    def __init__(self, device: torch.device, size: int, slots: int = 4) -> None:
        self._cuda = device.type == "cuda"
        self._host = [
            torch.empty(size, dtype=torch.int64, pin_memory=self._cuda) for _ in range(slots)
        ]
        self._host_np = [h.numpy() for h in self._host]
        self._device = [torch.empty(size, dtype=torch.int64, device=device) for _ in range(slots)]
        # An event never recorded queries as complete: a fresh slot is free.
        self._copied = [torch.cuda.Event() if self._cuda else None for _ in range(slots)]
        self._next = 0
        self._last: tuple[list[int], torch.Tensor] | None = None
        self.size = size
        self.uploads = 0

    @hot_path
    def upload(self, values: list[int]) -> torch.Tensor | None:
        """``values`` as a device tensor (stream-ordered), or ``None`` if every pinned
        buffer still has a copy in flight.

        The same values as last time return the same device tensor without a copy: a
        training loop in steady state gets its activations at the same addresses every
        step (the caching allocator replays its pattern), and the copy with its event
        is three torch calls of host time. That tensor is never
        rewritten while it is the last one: the next different table goes to the next
        slot, stream-ordered after every kernel that read this one.
        """
        last = self._last
        if last is not None and last[0] == values:
            return last[1]
        i = self._next
        event = self._copied[i]
        if event is not None and not event.query():
            return None
        self._next = (i + 1) % len(self._host)
        n = len(values)
        self._host_np[i][:n] = values
        device = self._device[i] if n == self.size else self._device[i][:n]
        device.copy_(
            self._host[i] if n == self.size else self._host[i][:n], non_blocking=self._cuda
        )
        if event is not None:
            event.record()
        self._last = (list(values), device)
        self.uploads += 1
        return device
