"""Monitors that were active at a step and recorded nothing: their hooks did not run.

A silent monitor looks like a healthy one with nothing to report, and it is the failure
that CUDA graphs make easy: a graph captured before ``attach`` replays the step without
the hooks, and a model whose modules were swapped after ``attach`` runs modules nobody
hooked. Neither raises anything. So each readout is checked: a monitor active at the
readout's step whose metrics are all absent from it (the cluster-wide values: a
pipeline stage without its layers does not count) was silent at that step. After
``SILENT_STEPS`` such readouts in a row the handle says so once, with the likely causes,
and ``monitors/self/<name>_silent_steps_count`` counts them from then on.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from syncless.metrics import MetricSet, Readout

#: Consecutive silent readouts before the warning (one can be a skipped optimizer step).
SILENT_STEPS = 3


class SilentMonitors:
    """Checks readouts for active monitors that recorded nothing (module doc)."""

    def __init__(self, metrics: MetricSet, names: Iterable[str], emit: bool) -> None:
        keys: dict[str, list[str]] = {name: [] for name in names}
        for spec in metrics.specs:
            gate = metrics.gate_of(spec.key)
            if gate in keys:
                keys[gate].append(spec.key)
        self._keys = {name: k for name, k in keys.items() if k}  # monitors with metrics
        self._emit = emit
        self._in_a_row = dict.fromkeys(self._keys, 0)
        self.counts = dict.fromkeys(self._keys, 0)  # silent readouts, cumulative
        self.warned: set[str] = set()

    def check(self, readout: Readout, active: Iterable[str]) -> None:
        """Count the monitors in ``active`` that recorded nothing in ``readout``."""
        present = readout.present
        for name in active:
            keys = self._keys.get(name)
            if keys is None:
                continue
            if any(key in present and present[key].any() for key in keys):
                self._in_a_row[name] = 0
                continue
            self._in_a_row[name] += 1
            self.counts[name] += 1
            if self._in_a_row[name] >= SILENT_STEPS and name not in self.warned:
                self.warned.add(name)
                if self._emit:
                    print(f"syncless: {_message(name)}", file=sys.stderr)

    def records(self, area: str) -> dict[str, float]:
        return {
            f"{area}/self/{name}_silent_steps_count": float(n)
            for name, n in self.counts.items()
            if n
        }


def _message(name: str) -> str:
    return (
        f"monitor {name} recorded nothing in {SILENT_STEPS} steps in a row where it was "
        "active: its hooks did not run. A CUDA graph captured before attach() replays the "
        "step without them (capture after attach, or re-capture); so does a model whose "
        "modules changed after attach() (attach again). Counted in "
        f"monitors/self/{name}_silent_steps_count."
    )
