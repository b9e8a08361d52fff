"""Host-side values of one flush: per key arrays, derived means and globals over layers.

Decoding and emitting run on the training thread once per flushed step, for every
declared element (25,682 on the demo's large preset, 24,576 of them per-channel maxima).
So everything that depends only on the schema -- where each element sits, its name,
which key it summarises into -- is computed once at allocate in a :class:`Layout`, and
a flush is a few whole-array numpy passes plus one list per record kind.

Flat element order is the buffer's: the mean/sum elements (declaration order), then
the max/min elements, then the globals over layers. Each region is contiguous in the
packed buffer (``[sums | counts | maxima]``), so decoding it is a slice, one divide
and one compare, not a gather and several selects per element (bench/monitors/flush.py:
decode and records of the demo large schema 0.54 -> 0.25 ms on a 2-core CPU).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from syncless.metrics.schema import MetricSpec
from syncless.run.records import StepRecord, step_records


@dataclass
class _Global:
    """A layer metric's over-layers key: its flat element indices in every layer."""

    key: str
    spec: MetricSpec
    index: np.ndarray  # [layers, size] indices into the flat decoded arrays
    span: slice | None = None  # the same elements when the layers sit back to back

    def take(self, flat: np.ndarray, offset: int = 0) -> np.ndarray:
        """``flat``'s ``[layers, size]`` elements (flat starting at ``offset``): a view
        when the layers are contiguous (the per-channel global is 24 x 1,024 elements)."""
        if self.span is not None:
            return flat[self.span.start - offset : self.span.stop - offset].reshape(
                self.index.shape
            )
        return flat[self.index - offset]


class Layout:
    """Where each declared element lives in the packed buffer, and what it emits.

    ``offsets`` are the specs' ``(sum, count, max)`` buffer starts (``MetricSet``):
    ``n_sum`` mean/sum elements, then as many counts, then ``n_max`` max/min elements.
    """

    def __init__(
        self, specs: list[MetricSpec], offsets: list[tuple], n_sum: int, n_max: int
    ) -> None:
        self.specs = specs
        self.n_sum, self.n_max = n_sum, n_max
        self.n_elements = n_sum + n_max
        self.is_mean = np.zeros(n_sum, dtype=bool)
        self.sign = np.ones(n_max)  # -1 where a min metric is stored negated
        starts: dict[str, int] = {}
        for spec, (s, _, m) in zip(specs, offsets, strict=True):
            if s is not None:
                self.is_mean[s : s + spec.size] = spec.agg == "mean"
                starts[spec.key] = s
            else:
                at = m - 2 * n_sum
                self.sign[at : at + spec.size] = -1.0 if spec.agg == "min" else 1.0
                starts[spec.key] = n_sum + at
        self.has_min = bool((self.sign < 0).any())
        ordered = sorted(specs, key=lambda spec: starts[spec.key])
        self.globals = self._globals(ordered, starts)
        entries = [(s.key, s, starts[s.key]) for s in ordered]
        at = self.n_elements
        for g in self.globals:
            entries.append((g.key, g.spec, at))
            at += g.spec.size
        self.n_flat = at
        self._emission(entries)

    @staticmethod
    def _globals(ordered: list[MetricSpec], starts: dict[str, int]) -> list[_Global]:
        by_global: dict[str, list[MetricSpec]] = {}
        for spec in ordered:
            if spec.global_key is not None:
                by_global.setdefault(spec.global_key, []).append(spec)
        out = []
        for gkey, parts in by_global.items():
            if len({spec.size for spec in parts}) > 1:
                continue  # e.g. MoE layers with different expert counts: no elementwise global
            index = np.stack([np.arange(starts[p.key], starts[p.key] + p.size) for p in parts])
            contiguous = bool((np.diff(index[:, 0]) == parts[0].size).all())
            span = slice(int(index[0, 0]), int(index[-1, -1]) + 1) if contiguous else None
            out.append(_Global(gkey, parts[0], index, span))
        return out

    def _emission(self, entries: list[tuple[str, MetricSpec, int]]) -> None:
        """Keys (flat order), their starts and aggregations, the emitted elements' names."""
        self.keys = [key for key, _, _ in entries]
        self.key_specs = {key: spec for key, spec, _ in entries}
        self.key_starts = np.array([start for _, _, start in entries], dtype=np.int64)
        self.slices = {key: (start, start + spec.size) for key, spec, start in entries}
        emit_index: list[int] = []
        emit_names: list[str] = []
        for key, spec, start in entries:
            if spec.size > 1 and spec.emit_elements:
                width = len(str(spec.size - 1))
                emit_index += range(start, start + spec.size)
                emit_names += [f"{key}/{spec.element}_{i:0{width}d}" for i in range(spec.size)]
        self.emit_index = np.array(emit_index, dtype=np.int64)
        self.emit_names = emit_names
        self.all_names = self.keys + emit_names
        # Key segments by region: summaries are one reduceat per region.
        n_sum_keys = int(np.searchsorted(self.key_starts, self.n_sum))
        n_spec_keys = int(np.searchsorted(self.key_starts, self.n_elements))
        self.sum_keys = slice(0, n_sum_keys)
        self.max_keys = slice(n_sum_keys, n_spec_keys)
        self.global_keys = slice(n_spec_keys, len(entries))
        kinds = [spec.agg for _, spec, _ in entries]
        self.key_is_mean = np.array([k == "mean" for k in kinds[self.sum_keys]], dtype=bool)
        self.key_sign = np.array([-1.0 if k == "min" else 1.0 for k in kinds[self.max_keys]])
        self.global_kind = [k for k in kinds[self.global_keys]]
        self._stacks: dict[tuple[str, ...], slice | np.ndarray] = {}

    def stack_index(self, keys: tuple[str, ...]) -> slice | np.ndarray:
        """Flat positions of ``keys`` (all of one length) as ``[len(keys), size]``: a
        slice when they sit back to back (a monitor declares its layers in a row, so
        usually a view), else an index array. Built once per tuple of keys."""
        index = self._stacks.get(keys)
        if index is None:
            bounds = [self.slices[k] for k in keys]
            sizes = {end - start for start, end in bounds}
            if len(sizes) != 1:
                raise ValueError(f"stack() needs keys of one length, got sizes {sorted(sizes)}")
            contiguous = all(a[1] == b[0] for a, b in pairwise(bounds))
            if contiguous:
                index = slice(bounds[0][0], bounds[-1][1])
            else:
                index = np.stack([np.arange(start, end) for start, end in bounds])
            self._stacks[keys] = index
        return index


class _FlatView(Mapping[str, np.ndarray]):
    """``key -> array`` views into one flat array, sliced on access (no per-flush dict)."""

    __slots__ = ("_flat", "_slices")

    def __init__(self, flat: np.ndarray, slices: dict[str, tuple[int, int]]) -> None:
        self._flat, self._slices = flat, slices

    def __getitem__(self, key: str) -> np.ndarray:
        start, end = self._slices[key]
        return self._flat[start:end]

    def __contains__(self, key: object) -> bool:
        return key in self._slices

    def __iter__(self) -> Iterator[str]:
        return iter(self._slices)

    def __len__(self) -> int:
        return len(self._slices)


@dataclass
class Readout:
    """Values of one flushed step, cluster-wide (already reduced across ranks).

    ``values[key]`` is a float64 array of the metric's length and ``present[key]`` says
    which elements received a record on some rank. A NaN or inf that was recorded is
    kept (a max over a NaN is NaN): only elements nobody recorded are absent. Globals
    of layer metrics are under ``area/global/name``. ``flat_values``/``flat_present``
    hold every key's elements in ``layout`` order (``layout.slices[key]``), for
    monitors that derive over many keys at once.
    """

    step: int
    values: Mapping[str, np.ndarray] = field(default_factory=dict)
    present: Mapping[str, np.ndarray] = field(default_factory=dict)
    specs: Mapping[str, MetricSpec] = field(default_factory=dict)
    layout: Layout | None = None
    flat_values: np.ndarray | None = None
    flat_present: np.ndarray | None = None

    def get(self, key: str) -> np.ndarray | None:
        """The metric's values with absent elements as NaN, or None if not declared."""
        if key not in self.values:
            return None
        return np.where(self.present[key], self.values[key], np.nan)

    def stack(self, keys: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Values and presence of ``keys`` (declared keys of one length) as
        ``[len(keys), size]`` arrays, e.g. one metric over every layer."""
        assert self.layout is not None and self.flat_values is not None
        assert self.flat_present is not None
        index = self.layout.stack_index(keys)
        shape = (len(keys), -1)
        if isinstance(index, slice):
            return self.flat_values[index].reshape(shape), self.flat_present[index].reshape(shape)
        return self.flat_values[index], self.flat_present[index]

    def records(self, run: str, rank: int, time: float) -> list[StepRecord]:
        """One summary record per key with data, plus one per element where emitted."""
        layout, values, present = self.layout, self.flat_values, self.flat_present
        assert layout is not None and values is not None and present is not None
        summary, has_data = _summaries(values, present, layout)
        emit_present = present[layout.emit_index]
        if has_data.all() and emit_present.all():
            # Every key and element has data (every step of a steady run): the names
            # are the layout's, no per-name selection.
            names = layout.all_names
            chosen = np.concatenate([summary, values[layout.emit_index]])
            return step_records(run, self.step, rank, names, chosen.tolist(), time)
        keys = layout.keys
        with_data = np.flatnonzero(has_data)
        emitted = np.flatnonzero(emit_present)  # positions in emit_names
        names = layout.emit_names
        return step_records(
            run,
            self.step,
            rank,
            [keys[i] for i in with_data.tolist()] + [names[i] for i in emitted.tolist()],
            summary[with_data].tolist() + values[layout.emit_index[emitted]].tolist(),
            time,
        )


def _summaries(
    values: np.ndarray, present: np.ndarray, layout: Layout
) -> tuple[np.ndarray, np.ndarray]:
    """Per key: mean, sum, max or min over its present elements, and whether it has one.

    A vector key's mean is the plain mean of its elements (e.g. over heads).
    """
    starts = layout.key_starts
    n_sum, n_elem = layout.n_sum, layout.n_elements
    out, has = [], []
    with np.errstate(invalid="ignore", divide="ignore"):
        if n_sum:
            seg = starts[layout.sum_keys]
            p = present[:n_sum]
            n = np.add.reduceat(p.astype(np.float64), seg)
            total = np.add.reduceat(np.where(p, values[:n_sum], 0.0), seg)
            out.append(np.where(layout.key_is_mean, total / n, total))
            has.append(n > 0)
        if n_elem > n_sum:
            seg = starts[layout.max_keys] - n_sum
            region = values[n_sum:n_elem]
            # Absent max elements hold -inf and absent min elements +inf (un-negated), so
            # a plain reduce finds the extreme over present elements; a NaN propagates.
            top = np.maximum.reduceat(region * layout.sign if layout.has_min else region, seg)
            out.append(top * layout.key_sign)
            has.append(top != -np.inf)  # a recorded NaN or inf counts as data
        for (start, end), kind in zip(
            (layout.slices[k] for k in layout.keys[layout.global_keys]),
            layout.global_kind,
            strict=True,
        ):
            v, p = values[start:end], present[start:end]
            has.append(np.array([p.any()]))
            chosen = v[p]
            if not chosen.size:
                out.append(np.array([np.nan]))
                continue
            reduce = {"mean": np.mean, "sum": np.sum, "max": np.max, "min": np.min}[kind]
            out.append(np.array([reduce(chosen)]))
    if not out:  # nothing declared (e.g. only monitors with nothing to watch)
        return np.zeros(0), np.zeros(0, dtype=bool)
    return np.concatenate(out), np.concatenate(has)


def decode(step: int, host: np.ndarray, layout: Layout) -> Readout:
    """Turn the packed host buffer into per-key arrays and derive globals over layers.

    A mean is the count-weighted mean over every rank's samples (sums and counts were
    reduced separately), never an average of per-rank means.
    """
    n_sum, n_max = layout.n_sum, layout.n_max
    sums, counts = host[:n_sum], host[n_sum : 2 * n_sum]
    raw = host[2 * n_sum : 2 * n_sum + n_max]  # running extremes, min stored negated
    with np.errstate(invalid="ignore", divide="ignore"):
        sum_values = np.where(layout.is_mean, sums / counts, sums)
    # A copy either way: the pinned buffer is rewritten by a later flush.
    max_values = raw * layout.sign if layout.has_min else raw.copy()
    values = [sum_values, max_values]
    present = [counts > 0, raw != -np.inf]  # untouched extremes stay at -inf; NaN counts
    for g in layout.globals:
        values_g, present_g = _global(g, sums, counts, max_values, present[1], n_sum)
        values.append(values_g)
        present.append(present_g)
    flat_values = np.concatenate(values)
    flat_present = np.concatenate(present)
    return Readout(
        step,
        values=_FlatView(flat_values, layout.slices),
        present=_FlatView(flat_present, layout.slices),
        specs=layout.key_specs,
        layout=layout,
        flat_values=flat_values,
        flat_present=flat_present,
    )


def _global(
    g: _Global,
    sums: np.ndarray,
    counts: np.ndarray,
    max_values: np.ndarray,
    max_present: np.ndarray,
    n_sum: int,
) -> tuple[np.ndarray, np.ndarray]:
    """A global over layers: count-weighted for means, summed for sums, the extreme of
    the present layers for max/min (a NaN in a present layer propagates)."""
    agg = g.spec.agg
    if agg in ("mean", "sum"):
        count = g.take(counts).sum(axis=0)  # in the sum region: flat index == buffer index
        with np.errstate(invalid="ignore", divide="ignore"):
            total = g.take(sums).sum(axis=0)
            return (total / count if agg == "mean" else total), count > 0
    # Absent elements hold the identity (-inf for max, +inf for min once un-negated), so
    # a plain reduce is the extreme of the present layers; a recorded NaN propagates.
    values = g.take(max_values, n_sum)
    value = values.max(axis=0) if agg == "max" else values.min(axis=0)
    return value, g.take(max_present, n_sum).any(axis=0)
