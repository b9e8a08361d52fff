"""Host-side values of one flush: per key arrays, derived means and globals over layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from syncless.metrics.schema import MetricSpec
from syncless.run.records import StepRecord


@dataclass
class Readout:
    """Values of one flushed step, cluster-wide (already reduced across ranks).

    ``values[key]`` is a float64 array of the metric's length and ``present[key]`` says
    which elements received a record on some rank. A NaN or inf that was recorded is
    kept (a max over a NaN is NaN): only elements nobody recorded are absent. Globals
    of layer metrics are under ``area/global/name``.
    """

    step: int
    values: dict[str, np.ndarray] = field(default_factory=dict)
    present: dict[str, np.ndarray] = field(default_factory=dict)
    specs: dict[str, MetricSpec] = field(default_factory=dict)

    def get(self, key: str) -> np.ndarray | None:
        """The metric's values with absent elements as NaN, or None if not declared."""
        if key not in self.values:
            return None
        return np.where(self.present[key], self.values[key], np.nan)

    def scalar(self, key: str) -> float | None:
        """Summary over present elements by the metric's aggregation; None if none."""
        mask = self.present[key]
        if not mask.any():
            return None
        arr = self.values[key][mask]
        agg = self.specs[key].agg
        if agg == "max":
            return float(np.max(arr))
        if agg == "min":
            return float(np.min(arr))
        if agg == "sum":
            return float(np.sum(arr))
        return float(np.mean(arr))

    def records(self, run: str, rank: int, time: float) -> list[StepRecord]:
        """One summary record per key with data, plus one per element where emitted."""
        out = []
        for key, arr in self.values.items():
            summary = self.scalar(key)
            if summary is None:
                continue
            out.append(StepRecord(run, self.step, rank, key, summary, time))
            spec = self.specs[key]
            if spec.size > 1 and spec.emit_elements:
                width = len(str(spec.size - 1))
                for i in np.flatnonzero(self.present[key]):
                    name = f"{key}/{spec.element}_{i:0{width}d}"
                    out.append(StepRecord(run, self.step, rank, name, float(arr[i]), time))
        return out


def _mean_or_sum(agg: str, total: np.ndarray, count: np.ndarray) -> np.ndarray:
    if agg == "sum":
        return total.copy()
    with np.errstate(invalid="ignore", divide="ignore"):
        return total / count


def decode(step: int, host: np.ndarray, specs: list[MetricSpec], offsets: list[tuple]) -> Readout:
    """Turn the packed host buffer into per-key arrays and derive globals over layers.

    A mean is the count-weighted mean over every rank's samples (sums and counts were
    reduced separately), never an average of per-rank means.
    """
    out = Readout(step)
    groups: dict[str, list[tuple[MetricSpec, np.ndarray, np.ndarray]]] = {}
    for spec, (s, c, m) in zip(specs, offsets, strict=True):
        n = spec.size
        if spec.agg in ("mean", "sum"):
            total, count = host[s : s + n], host[c : c + n]
            value, present = _mean_or_sum(spec.agg, total, count), count > 0
            raw = total
        else:
            extreme = host[m : m + n]
            present = ~np.isneginf(extreme)  # untouched elements stay at the -inf identity
            value = -extreme if spec.agg == "min" else extreme.copy()
            raw, count = value, present.astype(np.float64)
        out.values[spec.key], out.present[spec.key], out.specs[spec.key] = value, present, spec
        if spec.global_key is not None:
            groups.setdefault(spec.global_key, []).append((spec, raw, count))

    for gkey, parts in groups.items():
        spec = parts[0][0]
        if len({p[0].size for p in parts}) > 1:
            continue  # e.g. MoE layers with different expert counts: no elementwise global
        raws = np.stack([p[1] for p in parts])
        counts = np.stack([p[2] for p in parts])
        present = counts.sum(axis=0) > 0
        if spec.agg in ("mean", "sum"):
            value = _mean_or_sum(spec.agg, raws.sum(axis=0), counts.sum(axis=0))
        else:
            fill = -np.inf if spec.agg == "max" else np.inf
            masked = np.where(counts > 0, raws, fill)  # a NaN in a present layer propagates
            value = masked.max(axis=0) if spec.agg == "max" else masked.min(axis=0)
        out.values[gkey], out.present[gkey], out.specs[gkey] = value, present, spec
    return out
