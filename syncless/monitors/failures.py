"""What went wrong inside the monitors: counted, reported once per place, never raised
into the training step unless the user asked for ``strict``.

A monitor that throws into a training loop gets removed, and a bug in one statistic
must not cost a run: every exception raised by syncless code in a hook, in
``handle.step``, in a readout or a derive, or in ``handle.close`` is caught at that
place, counted, and reported on stderr the first time it happens at that place (with
its cause: the exception and the line that raised it). The counts land in the run
store as ``monitors/self/errors_count`` (every place) and
``monitors/self/<place>_errors_count``, cumulative since attach.

Under ``torch.compile`` a hook is traced into the graph, and an exception while
tracing is re-raised: counting and printing inside a graph would run once at trace
time, not per step, and a print breaks the graph. (A ``try`` itself traces without a
break: dynamo's counters show none on torch 2.13.)
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle


class Failures:
    """Counts of caught exceptions by place (``"attention_hook"``, ``"step"``,
    ``"readout"``, ``"moe_derive"``, ``"close"``); thread-safe (hooks run on autograd's
    thread, readouts on the readout thread)."""

    def __init__(self, strict: bool = False, rank: int | None = None) -> None:
        self.strict = strict
        self.counts: dict[str, int] = {}
        self._where = "" if rank is None else f" (rank {rank})"
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def failed(self, place: str, error: BaseException) -> None:
        """Count ``error`` at ``place``; report it the first time; raise it if strict.

        Call from an ``except`` block (``raise`` re-raises the active exception with its
        traceback)."""
        with self._lock:
            n = self.counts[place] = self.counts.get(place, 0) + 1
        if self.strict:
            raise error
        if n == 1:
            print(
                f"syncless: monitors: {place.replace('_', ' ')} failed{self._where}: "
                f"{error!r}{_origin(error)}; training goes on (further failures are "
                f"counted in monitors/self/{place}_errors_count; attach(strict=True) "
                "raises them)",
                file=sys.stderr,
            )

    def records(self, area: str) -> dict[str, float]:
        """``area/self/errors_count`` (always) and the count of every place that failed."""
        with self._lock:
            counts = dict(self.counts)
        out = {f"{area}/self/{place}_errors_count": float(n) for place, n in counts.items()}
        out[f"{area}/self/errors_count"] = float(sum(counts.values()))
        return out

    def guard(self, place: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its exceptions counted at ``place`` (returning None: a hook's
        "leave the tensors alone"). ~0.1 us a call on a 2-core CPU (the extra frame;
        the ``try`` is free), so ``is_compiling`` is asked only after a failure."""
        failures = self

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if torch.compiler.is_compiling():
                    raise
                failures.failed(place, e)
                return None

        return guarded

    def guard_hook(self, handle: RemovableHandle, place: str) -> None:
        """Wrap the hook behind ``handle`` (a module or optimizer hook) in place, so that
        the adapters' own hook code, not only the monitors' callbacks, is guarded. A
        hook that is a monitor's callback itself (``MonitorContext.timed``: guarded
        already), gone, or not torch's is left as it is."""
        ref = getattr(handle, "hooks_dict_ref", None)
        hooks = ref() if callable(ref) else None
        if hooks is None or handle.id not in hooks:
            return
        fn = hooks[handle.id]
        if not getattr(fn, "guarded", False):
            hooks[handle.id] = self.guard(place, fn)


def _origin(error: BaseException) -> str:
    """`` at file:line in function`` of the innermost syncless frame that raised
    ``error`` (a numpy or torch frame under it says less), else the innermost."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    ours = [f for f in frames if f"{os.sep}syncless{os.sep}" in f.filename]
    last = (ours or frames)[-1]
    return f" at {last.filename}:{last.lineno} in {last.name}"
