"""Host-side values of one flush: per key arrays, derived means and globals over layers.

Decoding and emitting run on the training thread once per flushed step, for every
declared element (about 1,500 on the demo's large preset, where a per-key Python loop
cost ~10 ms of a 320 ms host-bound step). So everything that depends only on the schema
-- where each element sits in the packed buffer, its name, which key it summarises
into -- is computed once at allocate in a :class:`Layout`, and a flush is a handful of
numpy passes over flat arrays plus one list comprehension per record kind.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from syncless.metrics.schema import MetricSpec
from syncless.run.records import StepRecord, step_records

_MEAN, _SUM, _MAX, _MIN = 0, 1, 2, 3
_KIND = {"mean": _MEAN, "sum": _SUM, "max": _MAX, "min": _MIN}


@dataclass
class _Global:
    """A layer metric's over-layers key: its element indices in every layer, stacked."""

    key: str
    spec: MetricSpec
    index: np.ndarray  # [layers, size] indices into the flat decoded arrays


class Layout:
    """Where each declared element lives in the packed buffer, and what it emits.

    Flat element order: the specs' elements in declaration order, then the globals'.
    """

    def __init__(self, specs: list[MetricSpec], offsets: list[tuple]) -> None:
        self.specs = specs
        sizes = [s.size for s in specs]
        self.n_elements = sum(sizes)
        self.starts = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
        src = np.empty(self.n_elements, dtype=np.int64)
        cnt = np.full(self.n_elements, -1, dtype=np.int64)
        kind = np.empty(self.n_elements, dtype=np.int8)
        by_global: dict[str, list[tuple[MetricSpec, int]]] = {}
        for spec, (s, c, m), start in zip(specs, offsets, self.starts.tolist(), strict=True):
            span = slice(start, start + spec.size)
            if spec.agg in ("mean", "sum"):
                src[span] = np.arange(s, s + spec.size)
                cnt[span] = np.arange(c, c + spec.size)
            else:
                src[span] = np.arange(m, m + spec.size)
            kind[span] = _KIND[spec.agg]
            if spec.global_key is not None:
                by_global.setdefault(spec.global_key, []).append((spec, int(start)))
        self.src, self.kind = src, kind
        self.has_count = cnt >= 0
        self.cnt = np.where(self.has_count, cnt, 0)
        self.globals: list[_Global] = []
        for gkey, parts in by_global.items():
            if len({spec.size for spec, _ in parts}) > 1:
                continue  # e.g. MoE layers with different expert counts: no elementwise global
            size = parts[0][0].size
            index = np.stack([np.arange(start, start + size) for _, start in parts])
            self.globals.append(_Global(gkey, parts[0][0], index))
        self._emission()

    def _emission(self) -> None:
        """Keys, summary starts, aggregations and element names over specs + globals."""
        entries = [(s.key, s) for s in self.specs] + [(g.key, g.spec) for g in self.globals]
        self.keys = [key for key, _ in entries]
        sizes = [spec.size for _, spec in entries]
        self.key_starts = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
        self.key_kind = np.array([_KIND[spec.agg] for _, spec in entries], dtype=np.int8)
        names: list[str | None] = []
        emit: list[bool] = []
        for key, spec in entries:
            each = spec.size > 1 and spec.emit_elements
            width = len(str(spec.size - 1))
            names += [f"{key}/{spec.element}_{i:0{width}d}" if each else None for i in range(spec.size)]  # fmt: skip
            emit += [each] * spec.size
        self.element_names = names
        self.emit_element = np.array(emit, dtype=bool)
        self.key_specs = dict(entries)
        self.slices = {
            key: (start, start + spec.size)
            for (key, spec), start in zip(entries, self.key_starts.tolist(), strict=True)
        }


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
    of layer metrics are under ``area/global/name``.
    """

    step: int
    values: Mapping[str, np.ndarray] = field(default_factory=dict)
    present: Mapping[str, np.ndarray] = field(default_factory=dict)
    specs: Mapping[str, MetricSpec] = field(default_factory=dict)
    layout: Layout | None = None
    flat_values: np.ndarray | None = None  # specs' then globals' elements (Layout order)
    flat_present: np.ndarray | None = None

    def get(self, key: str) -> np.ndarray | None:
        """The metric's values with absent elements as NaN, or None if not declared."""
        if key not in self.values:
            return None
        return np.where(self.present[key], self.values[key], np.nan)

    def records(self, run: str, rank: int, time: float) -> list[StepRecord]:
        """One summary record per key with data, plus one per element where emitted."""
        layout, values, present = self.layout, self.flat_values, self.flat_present
        assert layout is not None and values is not None and present is not None
        counts = np.add.reduceat(present.astype(np.float64), layout.key_starts)
        summary = _summaries(values, present, layout.key_starts, layout.key_kind)
        step, keys, names = self.step, layout.keys, layout.element_names
        with_data = np.flatnonzero(counts > 0)
        elements = np.flatnonzero(present & layout.emit_element)
        return step_records(
            run,
            step,
            rank,
            [keys[i] for i in with_data.tolist()] + [names[i] for i in elements.tolist()],
            summary[with_data].tolist() + values[elements].tolist(),
            time,
        )


def _summaries(
    values: np.ndarray, present: np.ndarray, starts: np.ndarray, kinds: np.ndarray
) -> np.ndarray:
    """Per segment (``starts``): mean, sum, max or min over its present elements."""
    with np.errstate(invalid="ignore", divide="ignore"):
        n = np.add.reduceat(present.astype(np.float64), starts)
        total = np.add.reduceat(np.where(present, values, 0.0), starts)
        top = np.maximum.reduceat(np.where(present, values, -np.inf), starts)
        low = np.minimum.reduceat(np.where(present, values, np.inf), starts)
        return np.select(
            [kinds == _MEAN, kinds == _SUM, kinds == _MAX], [total / n, total, top], low
        )


def decode(step: int, host: np.ndarray, layout: Layout) -> Readout:
    """Turn the packed host buffer into per-key arrays and derive globals over layers.

    A mean is the count-weighted mean over every rank's samples (sums and counts were
    reduced separately), never an average of per-rank means.
    """
    raw = host[layout.src]  # sums, or running extremes (min stored negated)
    count_raw = host[layout.cnt]
    kind = layout.kind
    with np.errstate(invalid="ignore", divide="ignore"):
        # untouched max/min elements stay at the -inf identity
        present = np.where(layout.has_count, count_raw > 0, ~np.isneginf(raw))
        value = np.where(kind == _MEAN, raw / count_raw, np.where(kind == _MIN, -raw, raw))
    count = np.where(layout.has_count, count_raw, present.astype(np.float64))
    summed = np.where(layout.has_count, raw, value)  # what a global over layers combines

    g_values, g_present = [], []
    for g in layout.globals:
        raws, counts = summed[g.index], count[g.index]
        g_count = counts.sum(axis=0)
        agg = g.spec.agg
        if agg in ("mean", "sum"):
            with np.errstate(invalid="ignore", divide="ignore"):
                gv = raws.sum(axis=0) / (g_count if agg == "mean" else 1.0)
        else:
            fill = -np.inf if agg == "max" else np.inf
            masked = np.where(counts > 0, raws, fill)  # a NaN in a present layer propagates
            gv = masked.max(axis=0) if agg == "max" else masked.min(axis=0)
        g_values.append(gv)
        g_present.append(g_count > 0)
    flat_values = np.concatenate([value, *g_values])
    flat_present = np.concatenate([present, *g_present])
    return Readout(
        step,
        values=_FlatView(flat_values, layout.slices),
        present=_FlatView(flat_present, layout.slices),
        specs=layout.key_specs,
        layout=layout,
        flat_values=flat_values,
        flat_present=flat_present,
    )
