"""Mergeable latency histograms: a DDSketch-style log mapping over a fixed index range.

Why this shape
    Per-rank latency quantiles cannot be averaged, and Prometheus-style fixed buckets
    (1 ms, 5 ms, ...) are too coarse to say anything about a p99. A log mapping gives
    every quantile the same *relative* error ``alpha``, and because the index range is
    fixed at construction every histogram with the same parameters has the same dense
    layout: per-rank histograms merge by elementwise sum, i.e. one ``all_reduce(SUM)``
    over ``to_array()`` plus one ``all_reduce(MAX)`` over ``max_array()``.

Mapping
    ``gamma = (1 + alpha) / (1 - alpha)``; a value ``x`` in ``[min_value, max_value]``
    goes to index ``i = ceil(log(x) / log(gamma))``, i.e. ``gamma**(i-1) < x <= gamma**i``,
    and the bucket's estimate ``2 * gamma**i / (gamma + 1)`` is within relative error
    ``alpha`` of every value in it. Defaults (values in milliseconds): ``alpha = 0.01``,
    ``min_value = 0.01`` (10 µs), ``max_value = 60_000`` (60 s): 782 buckets.

    * ``x < min_value`` (including 0 and negatives) is counted in an **underflow** bucket;
      a quantile that lands there is reported as ``min_value`` (an upper bound: "at most
      this"), clamped to the exact range.
    * ``x > max_value`` (including +inf) is counted in an **overflow** bucket; a quantile
      that lands there is reported as the exact maximum.
    * NaN is not recorded; it is counted in ``nan_count`` so that a run that produced
      NaN latencies says so.

    Exact ``count``, ``sum``, ``min`` and ``max`` are kept alongside the buckets.

Quantiles
    ``quantile(q)`` is the "lower" quantile: the value of the ``floor(q * (count - 1))``-th
    smallest sample (``numpy.quantile(..., method="lower")``), estimated within relative
    error ``alpha`` (for samples inside the range) and clamped to the exact
    ``[min, max]``; ``q = 0`` and ``q = 1`` return the exact extremes.

Gates (``percentiles_gated``)
    With tens of calls per step a "p99" is the maximum under another name. A quantile
    ``q`` is reported only when at least ``TAIL_SAMPLES = 5`` samples lie above it, i.e.
    ``count >= ceil(5 / (1 - q))``: **p50 needs 10 samples, p90 50, p99 500, p99.9
    5000**. Below its gate a quantile is omitted; report the exact ``max`` instead (it is
    always exact). Callers may pass their own ``min_samples`` per quantile.

Storage and cost
    ``record`` is pure Python (no numpy, no tensors: latencies are host timings). The
    bucket counts live in a Python list because incrementing a list item is markedly
    cheaper than incrementing a numpy array item; ``counts`` returns them as a dense
    int64 array, and ``record_many`` is vectorised with numpy.

Cross-rank layout
    ``to_array()``: float64 ``[underflow, bucket_0 .. bucket_{n-1}, overflow, nan_count,
    sum]`` (length ``array_size``), reduced with SUM (counts stay exact up to 2**53).
    ``max_array()``: float64 ``[max, -min]`` (min negated, the project's packed-MAX
    convention; ``-inf`` when empty), reduced with MAX. ``LogHistogram.from_array(sums,
    maxes, alpha=..., min_value=..., max_value=...)`` rebuilds a histogram; the
    parameters must match on every rank (they define the layout).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import accumulate

import numpy as np

__all__ = ["TAIL_SAMPLES", "LogHistogram", "min_samples_for"]

#: A quantile q is reported only when at least this many samples lie above it.
TAIL_SAMPLES = 5


def min_samples_for(q: float, tail_samples: int = TAIL_SAMPLES) -> int:
    """Samples needed before quantile ``q`` means more than the maximum: ``ceil(5/(1-q))``.

    p50 -> 10, p90 -> 50, p99 -> 500. ``q <= 0`` and ``q >= 1`` are the exact extremes and
    need one sample.
    """
    if q <= 0.0 or q >= 1.0:
        return 1
    # The epsilon absorbs float error: 5 / (1 - 0.9) is 50.000000000000014, not 50.
    return max(1, math.ceil(tail_samples / (1.0 - q) - 1e-9))


class LogHistogram:
    """A relative-error latency histogram with a fixed, mergeable layout (module docstring)."""

    __slots__ = (
        "_count",
        "_counts",
        "_gamma",
        "_i_min",
        "_inv_log_gamma",
        "_max",
        "_max_value",
        "_min",
        "_min_value",
        "_nan",
        "_offset",
        "_sum",
        "alpha",
    )

    def __init__(
        self, alpha: float = 0.01, min_value: float = 0.01, max_value: float = 60_000.0
    ) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
        if not (0.0 < min_value < max_value < math.inf):
            raise ValueError(
                f"need 0 < min_value < max_value < inf, got min_value={min_value!r}, "
                f"max_value={max_value!r}"
            )
        self.alpha = float(alpha)
        self._min_value = float(min_value)
        self._max_value = float(max_value)
        self._gamma = (1.0 + alpha) / (1.0 - alpha)
        self._inv_log_gamma = 1.0 / math.log(self._gamma)
        # The range ends are mapped with the same expression `record` uses, so every
        # value in [min_value, max_value] lands in [i_min, i_max] (log is monotone).
        self._i_min = math.ceil(math.log(self._min_value) * self._inv_log_gamma)
        i_max = math.ceil(math.log(self._max_value) * self._inv_log_gamma)
        # Slot layout: 0 = underflow, 1 .. n = buckets i_min .. i_max, n + 1 = overflow.
        self._offset = 1 - self._i_min
        self._counts = [0] * (i_max - self._i_min + 3)
        self._count = 0
        self._sum = 0.0
        self._min = math.inf
        self._max = -math.inf
        self._nan = 0

    # ------------------------------------------------------------------ recording

    def record(
        self,
        x: float,
        _log: Callable[[float], float] = math.log,
        _ceil: Callable[[float], int] = math.ceil,
    ) -> None:
        """Record one value (pure Python; the defaults bind math functions as locals)."""
        if x != x:  # NaN: counted, not binned (it has no place on a log axis)
            self._nan += 1
            return
        self._count += 1
        self._sum += x
        if x < self._min:
            self._min = x
        if x > self._max:
            self._max = x
        if x < self._min_value:
            self._counts[0] += 1
        elif x <= self._max_value:
            self._counts[_ceil(_log(x) * self._inv_log_gamma) + self._offset] += 1
        else:
            self._counts[-1] += 1

    def record_many(self, values: np.ndarray | Sequence[float]) -> None:
        """Record every value of an array (vectorised; same buckets as ``record``)."""
        x = np.asarray(values, dtype=np.float64).ravel()
        nan = np.isnan(x)
        n_nan = int(nan.sum())
        if n_nan:
            self._nan += n_nan
            x = x[~nan]
        if x.size == 0:
            return
        self._count += int(x.size)
        self._sum += float(x.sum())
        self._min = min(self._min, float(x.min()))
        self._max = max(self._max, float(x.max()))
        under = x < self._min_value
        over = x > self._max_value
        mid = x[~(under | over)]
        slots = np.ceil(np.log(mid) * self._inv_log_gamma).astype(np.int64) + self._offset
        add = np.bincount(slots, minlength=len(self._counts))
        add[0] += int(under.sum())
        add[-1] += int(over.sum())
        self._counts = (np.asarray(self._counts, dtype=np.int64) + add).tolist()

    # ------------------------------------------------------------------ merging

    @property
    def params(self) -> tuple[float, float, float]:
        """``(alpha, min_value, max_value)``: equal params mean an equal layout."""
        return (self.alpha, self._min_value, self._max_value)

    def _check_compatible(self, other: LogHistogram) -> None:
        if not isinstance(other, LogHistogram):
            raise TypeError(f"can only merge a LogHistogram, got {type(other).__name__}")
        if other.params != self.params:
            raise ValueError(
                "cannot merge histograms with different layouts: "
                f"(alpha, min_value, max_value) = {self.params} vs {other.params}"
            )

    def merge(self, other: LogHistogram) -> LogHistogram:
        """Add ``other``'s samples into this histogram (same params required); returns self."""
        self._check_compatible(other)
        self._counts = [a + b for a, b in zip(self._counts, other._counts, strict=True)]
        self._count += other._count
        self._sum += other._sum
        self._min = min(self._min, other._min)
        self._max = max(self._max, other._max)
        self._nan += other._nan
        return self

    @property
    def array_size(self) -> int:
        """Length of ``to_array()``: bucket slots (with under/overflow) + nan_count + sum."""
        return len(self._counts) + 2

    def to_array(self) -> np.ndarray:
        """The SUM-reducible part as float64: ``[underflow, buckets..., overflow, nan, sum]``."""
        out = np.empty(self.array_size, dtype=np.float64)
        out[:-2] = self._counts
        out[-2] = self._nan
        out[-1] = self._sum
        return out

    def max_array(self) -> np.ndarray:
        """The MAX-reducible part as float64: ``[max, -min]`` (``-inf`` when empty)."""
        return np.array([self._max, -self._min], dtype=np.float64)

    @classmethod
    def from_array(
        cls,
        sums: np.ndarray | Sequence[float],
        maxes: np.ndarray | Sequence[float],
        *,
        alpha: float = 0.01,
        min_value: float = 0.01,
        max_value: float = 60_000.0,
    ) -> LogHistogram:
        """Rebuild from ``to_array()`` / ``max_array()`` (possibly reduced across ranks)."""
        h = cls(alpha, min_value, max_value)
        s = np.asarray(sums, dtype=np.float64).ravel()
        m = np.asarray(maxes, dtype=np.float64).ravel()
        if s.size != h.array_size or m.size != 2:
            raise ValueError(
                f"array sizes {s.size}, {m.size} do not match the layout of params "
                f"{h.params}: expected {h.array_size}, 2"
            )
        counts = s[:-2]
        if np.any(counts < 0) or np.any(counts != np.round(counts)):
            raise ValueError("bucket counts must be non-negative integers")
        h._counts = counts.astype(np.int64).tolist()
        h._count = int(sum(h._counts))
        h._nan = int(s[-2])
        h._sum = float(s[-1])
        h._max = float(m[0])
        h._min = -float(m[1])
        return h

    # ------------------------------------------------------------------ reading

    @property
    def count(self) -> int:
        """Number of recorded (non-NaN) values."""
        return self._count

    @property
    def nan_count(self) -> int:
        """Number of NaN values offered and not recorded."""
        return self._nan

    @property
    def sum(self) -> float:
        return self._sum

    @property
    def min(self) -> float | None:
        """Exact minimum, ``None`` when empty."""
        return self._min if self._count else None

    @property
    def max(self) -> float | None:
        """Exact maximum, ``None`` when empty."""
        return self._max if self._count else None

    @property
    def mean(self) -> float | None:
        return self._sum / self._count if self._count else None

    @property
    def counts(self) -> np.ndarray:
        """Dense int64 copy of the slots: ``[underflow, buckets..., overflow]``."""
        return np.asarray(self._counts, dtype=np.int64)

    @property
    def underflow(self) -> int:
        return self._counts[0]

    @property
    def overflow(self) -> int:
        return self._counts[-1]

    def _slot_value(self, slot: int) -> float:
        if slot == 0:
            return self._min_value  # underflow: "at most min_value"
        if slot == len(self._counts) - 1:
            return self._max  # overflow: the exact maximum
        i = slot - self._offset
        return 2.0 * self._gamma**i / (self._gamma + 1.0)

    def quantiles(self, qs: Iterable[float]) -> list[float | None]:
        """``quantile(q)`` for each q, sharing one cumulative pass."""
        qs = list(qs)
        for q in qs:
            if not 0.0 <= q <= 1.0:
                raise ValueError(f"quantile must be in [0, 1], got {q!r}")
        n = self._count
        if n == 0:
            return [None] * len(qs)
        cum = list(accumulate(self._counts))
        out: list[float | None] = []
        for q in qs:
            if q == 0.0:
                out.append(self._min)
            elif q == 1.0:
                out.append(self._max)
            else:
                k = math.floor(q * (n - 1))  # 0-based rank of the "lower" quantile
                v = self._slot_value(bisect_right(cum, k))
                out.append(min(max(v, self._min), self._max))
        return out

    def quantile(self, q: float) -> float | None:
        """The q-quantile ("lower" definition) within relative error alpha; None if empty."""
        return self.quantiles((q,))[0]

    def percentiles_gated(
        self,
        qs: Sequence[float] = (0.5, 0.9, 0.99),
        min_samples: Mapping[float, int] | None = None,
    ) -> dict[float, float]:
        """Quantiles whose sample count passes their gate (``min_samples_for`` by default).

        ``min_samples`` overrides the gate for the quantiles it names. Omitted quantiles
        were not measurable from this many samples; report ``max`` for the tail instead.
        """
        gates = {q: (min_samples or {}).get(q, min_samples_for(q)) for q in qs}
        keep = [q for q in qs if self._count >= gates[q] and self._count > 0]
        return dict(zip(keep, self.quantiles(keep), strict=True))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ housekeeping

    def reset(self) -> None:
        """Forget every sample (the layout stays)."""
        self._counts = [0] * len(self._counts)
        self._count = 0
        self._sum = 0.0
        self._min = math.inf
        self._max = -math.inf
        self._nan = 0

    def copy(self) -> LogHistogram:
        h = LogHistogram(self.alpha, self._min_value, self._max_value)
        h._counts = list(self._counts)
        h._count, h._sum, h._min, h._max, h._nan = (
            self._count,
            self._sum,
            self._min,
            self._max,
            self._nan,
        )
        return h

    def __repr__(self) -> str:
        return (
            f"LogHistogram(alpha={self.alpha}, min_value={self._min_value}, "
            f"max_value={self._max_value}, count={self._count}, min={self.min}, max={self.max})"
        )
