"""``HostLanding``: copy a small device tensor to the host now, read it later.

The split lists of a dispatch must be on the host before the host can enqueue the
dispatch, but nothing says the read has to be where the counts are computed. ``issue``
starts a non-blocking copy into pinned host memory and records an event behind it;
``read`` waits on that event (only if it has not completed: counted and timed) and
reads the host memory. Work the caller enqueues between the two keeps the device busy
while the counts travel, so the host finds them landed instead of draining the stream.

On a CPU device there is nothing to overlap: the copy is synchronous and ``read``
never waits. The host buffer is read through a numpy view, which is host memory on
every device; ``syncless.guard``'s CPU simulation, which treats every CPU *tensor* as
device memory, would otherwise flag the read of a buffer that is really on the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from syncless.guard import allow_sync
from syncless.hot_path import hot_path
from syncless.pacing.limiter import EventLike, cuda_event


class HostLanding:
    """One small integer tensor in flight to the host at a time.

    ``event_factory`` and ``clock`` replace the CUDA event and the wait timer (tests);
    a given ``event_factory`` is used on every device.
    """

    def __init__(
        self,
        *,
        event_factory: Callable[[], EventLike] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._event_factory = event_factory
        self._clock = clock
        self._host: torch.Tensor | None = None
        self._view: np.ndarray | None = None
        self._event: EventLike | None = None
        self._pending = False
        self.reads = 0
        self.waits = 0  # reads that found the copy still in flight
        self.wait_s = 0.0
        self.max_wait_s = 0.0

    @hot_path
    def issue(self, values: torch.Tensor) -> None:
        """Start copying ``values`` (1-D, integer) to host memory; do not wait."""
        if self._pending:
            raise RuntimeError("HostLanding.issue() twice without read(): one copy at a time")
        host = self._buffer(values)
        host.copy_(values, non_blocking=True)
        if self._event is not None:
            self._event.record()
        self._pending = True

    @hot_path
    def read(self) -> list[int]:
        """The issued values as Python ints, waiting only if they have not landed."""
        if not self._pending:
            raise RuntimeError("HostLanding.read() without issue()")
        self._pending = False
        self.reads += 1
        event = self._event
        if event is not None and not event.query():
            start = self._clock()
            with allow_sync("lookahead splits: the counts have not landed yet"):
                event.synchronize()  # syncless: ok waits for one small copy, counted and timed
            waited = self._clock() - start
            self.waits += 1
            self.wait_s += waited
            self.max_wait_s = max(self.max_wait_s, waited)
        assert self._view is not None
        return self._view.tolist()  # syncless: ok a numpy view of host memory, landed above

    def _buffer(self, values: torch.Tensor) -> torch.Tensor:
        host = self._host
        if host is not None and host.shape == values.shape and host.dtype == values.dtype:
            return host
        on_cuda = values.device.type == "cuda"
        # Once per shape: pinning and the numpy view are setup, not per-call work.
        with allow_sync("lookahead splits: one-time pinned landing buffer"):
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=on_cuda)
            self._view = host.numpy()  # syncless: ok a view of host memory, made once
        self._host = host
        factory = self._event_factory or (cuda_event if on_cuda else None)
        self._event = factory() if factory is not None else None
        return host

    def stats(self) -> dict[str, float]:
        return {
            "reads": self.reads,
            "waits": self.waits,
            "wait_s": self.wait_s,
            "max_wait_s": self.max_wait_s,
        }
