"""Small int64 tables on the device, refreshed every step without a sync.

A grouped kernel finds layer ``l``'s tensor at ``offsets[l]`` elements from layer 0's,
and those addresses change every step. Building the table with ``torch.tensor(...,
device="cuda")`` would copy from pageable memory, which synchronizes. Here a table is
written into one of a few preallocated pinned buffers and copied with one
non-blocking copy; a pinned buffer is rewritten only once its last copy has completed
(an event query, no wait), and when none is free ``upload`` returns ``None`` so the
caller takes its per-layer path.

Under CUDA graph capture the table a captured kernel reads must stay as it is for as
long as the graph may replay: the slot it sits in is *frozen* (never rewritten), and a
new table is copied once, at capture, on a side stream outside the graph.
"""

from __future__ import annotations

import torch

from syncless.cuda_driver import relaxed_capture
from syncless.graphs import capturing as graph_capturing
from syncless.hot_path import hot_path


class OffsetRing:
    """``slots`` pinned host buffers and device buffers of ``size`` int64 each."""

    def __init__(self, device: torch.device, size: int, slots: int = 4) -> None:
        self._cuda = device.type == "cuda"
        self._device_type = device
        self._host: list[torch.Tensor] = []
        self._host_np: list = []
        self._device: list[torch.Tensor] = []
        # An event never recorded queries as complete: a fresh slot is free.
        self._copied: list[torch.cuda.Event | None] = []
        self.size = size
        for _ in range(slots):
            self._add_slot()
        self._next = 0
        self._last: tuple[list[int], torch.Tensor, int] | None = None  # values, table, slot
        self._frozen: set[int] = set()  # slots a captured graph reads: never rewritten
        # The stream a table is uploaded on during a capture (made here: not mid-capture).
        self._side = torch.cuda.Stream(device) if self._cuda else None
        self.uploads = 0

    def _add_slot(self) -> None:
        host = torch.empty(self.size, dtype=torch.int64, pin_memory=self._cuda)
        self._host.append(host)
        self._host_np.append(host.numpy())  # syncless: ok a host tensor, viewed once per slot
        self._device.append(torch.empty(self.size, dtype=torch.int64, device=self._device_type))
        self._copied.append(torch.cuda.Event() if self._cuda else None)

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
        capturing = graph_capturing(self._cuda)
        if last is not None and last[0] == values:
            if capturing:
                self._frozen.add(last[2])
            return last[1]
        if capturing:
            return self._upload_captured(values)
        i = self._free_slot()
        if i is None:
            return None
        event = self._copied[i]
        if event is not None and not event.query():
            return None
        self._next = (i + 1) % len(self._host)
        device, host = self._write(i, values)
        device.copy_(host, non_blocking=self._cuda)
        if event is not None:
            event.record()
        self._last = (list(values), device, i)
        self.uploads += 1
        return device

    def _free_slot(self) -> int | None:
        """The next slot in turn that no graph froze, or None."""
        n = len(self._host)
        for step in range(n):
            i = (self._next + step) % n
            if i not in self._frozen:
                return i
        return None

    def _settled_slot(self) -> int | None:
        """A slot no graph froze whose last copy completed (capture: relaxed mode)."""
        for i, event in enumerate(self._copied):
            if i not in self._frozen and (event is None or event.query()):
                return i
        return None

    def _write(self, i: int, values: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``values`` into slot ``i``'s pinned buffer; (device, host) views of them."""
        n = len(values)
        self._host_np[i][:n] = values
        if n == self.size:  # no view: each is a torch call of host time
            return self._device[i], self._host[i]
        return self._device[i][:n], self._host[i][:n]

    def _upload_captured(self, values: list[int]) -> torch.Tensor | None:
        """Cold path, once per capture: copy ``values`` on the side stream and wait for
        it (the only sync, at capture; a replay reads the frozen slot and copies
        nothing). A ring whose slots are all frozen grows by one."""
        if not self._cuda:  # a CPU stand-in capture: the copy is recorded, its host kept
            i = self._settled_slot()
            if i is None:
                return None
            device, host = self._write(i, values)
            device.copy_(host)
            self._frozen.add(i)
            self._last = (list(values), device, i)
            return device
        with relaxed_capture() as relaxed:
            if not relaxed or self._side is None:
                return None
            i = self._settled_slot()
            if i is None:
                with torch.cuda.stream(self._side):
                    self._add_slot()
                i = len(self._host) - 1
            device, host = self._write(i, values)
            with torch.cuda.stream(self._side):
                device.copy_(host, non_blocking=True)
            self._side.synchronize()  # syncless: ok once at capture, never in a replay
        self._frozen.add(i)
        self._last = (list(values), device, i)
        self.uploads += 1
        return device
