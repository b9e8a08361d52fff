"""The slots one hooked module records, folded from one partials tensor in one launch.

A fused monitor kernel writes ``[P, N]`` float32 partials whose columns are, in order,
the elements of the group's :class:`Column` s. :meth:`SlotGroup.fold` reduces them and
updates every slot at once (:mod:`syncless.kernels.fold`): the module's whole record is
two launches, however many statistics it has, instead of 2-3 per slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from syncless.hot_path import hot_path
from syncless.metrics.metric_set import MetricSet
from syncless.metrics.slot import Slot


@dataclass(frozen=True)
class Column:
    """``width`` partials columns feeding one slot.

    ``slot``: a mean/sum slot (columns summed over partial rows, each element's count
    advanced by the fold's ``n_samples``) or a max slot (columns reduced by max).
    ``also_max``: a max slot that additionally receives the summed value (a per-call
    count feeding a "largest this step" alert); columns may share it (an atomic max,
    which orders non-negative values only: counts). ``start``: the first element of
    ``slot`` these columns write (a tensor-parallel shard writes its slice).
    ``slot=None``: ``width`` columns the fold skips (a grouped launch folds what only
    one column may update, such as a metric shared by every layer, on its own).
    ``first``: a min metric of the same width that receives the current step label
    (``MetricSet.step_label``) wherever the summed value is positive: the first step
    a count (of NaN/Inf values) went above zero since the last flush. Each column's
    target must be its own.
    """

    slot: Slot | None
    width: int | None = None
    start: int = 0
    also_max: Slot | None = None
    first: Slot | None = None


class SlotGroup:
    """Buffer targets of a module's columns, as a ``[5, N]`` device table built once:
    sum, count, max and first-step targets, and the gate each column records through.

    ``kernel_gate``: the one gate every column records through, as a device flag a
    partials kernel may read to skip its work when the fold would drop it (inside a
    CUDA graph, where the host cannot skip the launch); ``None`` when the columns'
    gates differ (that kernel always runs, and the fold gates each column).
    """

    def __init__(self, metrics: MetricSet, columns: list[Column]) -> None:
        if metrics.buffer is None:
            raise RuntimeError("SlotGroup needs an allocated MetricSet: allocate() first")
        self.metrics = metrics
        self.buffer = metrics.buffer
        self.gates = metrics.gates
        self.step = metrics.step_label
        names = {metrics.gate_of(c.slot.spec.key) for c in columns if c.slot is not None}
        shared = next(iter(names)) if len(names) == 1 else None
        self.kernel_gate = None if shared is None else metrics.gate_views(shared)[0]
        skipped = metrics.gate_index(shared or "")  # the gate of columns the fold skips
        sums: list[int] = []
        counts: list[int] = []
        maxima: list[int] = []
        firsts: list[int] = []
        gates: list[int] = []
        for col in columns:
            if col.slot is None:
                if col.width is None:
                    raise ValueError("a skipped Column(slot=None) needs its width")
                sums += [-1] * col.width
                counts += [-1] * col.width
                maxima += [-1] * col.width
                firsts += [-1] * col.width
                gates += [skipped] * col.width
                continue
            spec = col.slot.spec
            width = spec.size - col.start if col.width is None else col.width
            if col.start < 0 or col.start + width > spec.size:
                raise ValueError(
                    f"column [{col.start}, {col.start + width}) is outside metric "
                    f"{spec.key!r} of size {spec.size}"
                )
            gates += [metrics.gate_index(metrics.gate_of(spec.key))] * width
            s, c, m = _offsets(col.slot)
            if spec.agg == "min":
                raise ValueError(f"metric {spec.key!r}: min metrics are not foldable")
            elements = range(col.start, col.start + width)
            firsts += _first_targets(col, width)
            if spec.agg == "max":
                sums += [-1] * width
                counts += [-1] * width
                maxima += [m + e for e in elements]
                continue
            sums += [s + e for e in elements]
            counts += [c + e for e in elements]
            if col.also_max is None:
                maxima += [-1] * width
            else:
                alert = _offsets(col.also_max)[2]
                if col.also_max.spec.agg != "max" or col.also_max.spec.size != width:
                    raise ValueError(
                        f"also_max needs a max metric of size {width}, got "
                        f"{col.also_max.spec.key!r}"
                    )
                maxima += [alert + i for i in range(width)]
        taken = [f for f in firsts if f >= 0]
        if len(set(taken)) != len(taken):
            raise ValueError("columns share a first-step target: each needs its own")
        self.width = len(sums)
        self.table = torch.tensor([sums, counts, maxima, firsts, gates], dtype=torch.int64).to(
            self.buffer.device
        )

    @hot_path
    def fold(self, partials: torch.Tensor, n_samples: float) -> None:
        """Fold ``partials`` ``[P, width]`` into the slots; counts advance by ``n_samples``."""
        from syncless.kernels.fold import fold

        fold(partials, self.table, self.buffer, self.gates, self.step, n_samples)


def _first_targets(col: Column, width: int) -> list[int]:
    """Buffer indices of ``col``'s first-step min metric (stored negated), or -1s."""
    if col.first is None:
        return [-1] * width
    spec = col.first.spec
    if spec.agg != "min" or spec.size != width:
        raise ValueError(f"first needs a min metric of size {width}, got {spec.key!r}")
    return [_offsets(col.first)[2] + i for i in range(width)]


def _offsets(slot: Slot) -> tuple[int, int, int]:
    if slot.offsets is None:
        raise RuntimeError(f"metric {slot.spec.key!r} is not allocated: allocate() first")
    s, c, m = slot.offsets
    return (-1 if s is None else s, -1 if c is None else c, -1 if m is None else m)
