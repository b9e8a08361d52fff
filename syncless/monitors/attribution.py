"""The layer that moved first: from the first steps the device kept, per layer and signal.

Three signals name a step per layer, all min metrics written on the device and read
with a readout: the first step its output held a NaN/Inf (the nonfinite monitor), the
first step its output RMS left its band (the activations monitor, at its cadence) and
the first step the RMS of the gradient at its output left its band (the gradients
monitor, every step). The layer that moved first is the one with the earliest step.
Within one step the forward runs before the backward: an output signal comes first,
and of those the lowest layer (a NaN in layer 5's output is in every later layer's).
A gradient signal alone points to the highest layer whose gradient moved: the gradient
at a block's output comes from the blocks above it, so a layer whose weights blew up
shows first in the gradient of the block below it, and the highest such block is the
closest to the cause.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from syncless.metrics import MetricSet, Readout
from syncless.monitors.base import AREA

#: (what moved, its first-step metric, whether the forward computes it)
SIGNALS = (
    ("output NaN/Inf", "nonfinite_first_step", True),
    ("output RMS", "act_band_first_step", True),
    ("gradient RMS", "grad_out_band_first_step", False),
)


@dataclass(frozen=True)
class Moved:
    """A layer that moved first: ``step`` (as the device labelled it), ``layer`` and
    what moved (``signal``: one of ``SIGNALS``' names)."""

    step: float
    layer: int
    signal: str

    def describe(self, step: int | None = None) -> str:
        shown = int(self.step) if step is None else step
        return f"layer {self.layer} moved first ({self.signal}, step {shown})"


class Attribution:
    """Where each signal's per-layer first steps sit, in the buffer and in readouts."""

    def __init__(self, metrics: MetricSet) -> None:
        self._signals: list[tuple[str, bool, np.ndarray, tuple[str, ...], np.ndarray]] = []
        for name, metric, forward in SIGNALS:
            specs = metrics.layer_specs(AREA, metric)
            if not specs:
                continue
            layers = np.array(list(specs), dtype=np.int64)
            keys = tuple(spec.key for spec in specs.values())
            positions = np.array([metrics.slot(k).offsets[2] for k in keys], dtype=np.int64)  # type: ignore[index]
            self._signals.append((name, forward, layers, keys, positions))

    def __bool__(self) -> bool:
        return bool(self._signals)

    def in_buffer(self, host: np.ndarray) -> Moved | None:
        """From a flushed host copy of the buffer (min metrics are stored negated)."""
        found = []
        for name, forward, layers, _, positions in self._signals:
            steps = -host[positions]
            found.append((name, forward, layers, steps, np.isfinite(steps)))
        return _earliest(found)

    def in_readout(self, readout: Readout) -> Moved | None:
        """From a decoded readout (its step labels as ``step`` gave them)."""
        found = []
        for name, forward, layers, keys, _ in self._signals:
            steps, present = readout.stack(keys)
            steps, present = steps[:, 0], present[:, 0]
            found.append((name, forward, layers, steps, present & np.isfinite(steps)))
        return _earliest(found)


def _earliest(found: list) -> Moved | None:
    """The earliest step over every signal; within it, forward signals' lowest layer,
    else the gradients' highest."""
    best: tuple | None = None
    for name, forward, layers, steps, present in found:
        if not present.any():
            continue
        step = float(steps[present].min())
        at = np.flatnonzero(present & (steps == step))
        layer = int(layers[at].min() if forward else layers[at].max())
        rank = (step, 0 if forward else 1, layer if forward else -layer)
        if best is None or rank < best[0]:
            best = (rank, Moved(step, layer, name))
    return None if best is None else best[1]
