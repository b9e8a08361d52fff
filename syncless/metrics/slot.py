"""A declared metric's place in the packed device buffer, and its record ops.

Recording is a few in-place device ops on views fixed at allocate: no lookup, no
allocation, no sync, no branch on a value. Every op is gated by the device-side enable
flag, so "record every N steps" costs no retrace and no graph re-capture.
"""

from __future__ import annotations

import dataclasses

import torch

from syncless.metrics.schema import MetricSpec


class Slot:
    """Views into the packed buffer for one metric.

    ``sum``/``count`` live in the SUM region (mean and sum metrics; count per
    element, kept in float64 so it stays exact to 2^53 samples); ``max`` lives in the
    MAX region (max metrics, and min metrics stored negated).
    """

    __slots__ = (
        "_buffer", "_count", "_gate", "_gate_on", "_max", "_neg_inf", "_pair", "_sum",
        "offsets", "spec",
    )  # fmt: skip

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self._sum: torch.Tensor | None = None
        self._count: torch.Tensor | None = None
        self._max: torch.Tensor | None = None
        # (sum, count, max) start indices in the packed buffer, None where absent
        self.offsets: tuple[int | None, int | None, int | None] | None = None
        self._buffer: torch.Tensor | None = None
        self._pair: torch.Tensor | None = None  # [sum, count] buffer indices, for add_ones

    def bind(
        self,
        buffer: torch.Tensor,
        offsets: tuple[int | None, int | None, int | None],
        gate: torch.Tensor,
        gate_on: torch.Tensor,
        neg_inf: torch.Tensor,
    ) -> None:
        n = self.spec.size
        s, c, m = offsets
        self.offsets = offsets
        self._buffer = buffer
        self._sum = buffer[s : s + n] if s is not None else None
        self._count = buffer[c : c + n] if c is not None else None
        self._max = buffer[m : m + n] if m is not None else None
        self._gate, self._gate_on, self._neg_inf = gate, gate_on, neg_inf

    def views(self) -> list[torch.Tensor]:
        """The buffer views this slot records into (after ``bind``)."""
        return [t for t in (self._sum, self._count, self._max) if t is not None]

    def narrow(self, start: int, width: int) -> Slot:
        """A slot over elements ``start .. start + width - 1`` of this one (allocated):
        a tensor-parallel shard records its heads or channels into its slice, and the
        other elements stay neutral for the flush's reduce to fill from other ranks."""
        if self.offsets is None or self._buffer is None:
            raise self._unbound()
        if start < 0 or width < 1 or start + width > self.spec.size:
            raise ValueError(
                f"metric {self.spec.key!r}: elements [{start}, {start + width}) are "
                f"outside its {self.spec.size}"
            )
        if start == 0 and width == self.spec.size:
            return self
        part = Slot(dataclasses.replace(self.spec, size=width))
        part.bind(
            self._buffer,
            tuple(None if o is None else o + start for o in self.offsets),  # type: ignore[arg-type]
            self._gate,  # type: ignore[arg-type]
            self._gate_on,  # type: ignore[arg-type]
            self._neg_inf,  # type: ignore[arg-type]
        )
        return part

    def _unbound(self) -> RuntimeError:
        return RuntimeError(
            f"metric {self.spec.key!r} is declared but not allocated: call allocate() "
            "before the first record"
        )

    def add(self, total: torch.Tensor, count: int | torch.Tensor = 1) -> None:
        """Mean and sum metrics: add ``total`` (the sum of ``count`` samples)."""
        if self._sum is None or self._count is None:
            if self.spec.agg in ("max", "min"):
                raise TypeError(
                    f"metric {self.spec.key!r} is a {self.spec.agg} metric: use update()"
                )
            raise self._unbound()
        self._sum.addcmul_(total, self._gate)
        if isinstance(count, torch.Tensor):
            self._count.addcmul_(count, self._gate)
        else:
            self._count.add_(self._gate, alpha=count)

    def prepare_add_ones(self) -> None:
        """Cold path (attach time): the device index ``add_ones`` writes through."""
        s, c, _ = self.offsets or (None, None, None)
        if self._buffer is None or s is None or c is None or self.spec.size != 1:
            raise TypeError(
                f"add_ones needs an allocated scalar mean/sum metric; {self.spec.key!r} is "
                f"{self.spec.agg} of size {self.spec.size}"
            )
        self._pair = torch.tensor([s, c], device=self._buffer.device)

    def add_ones(self, n: float) -> None:
        """``n`` samples of value 1 (a fraction whose parts grow together): sum and
        count advance by ``n`` in one launch, where ``add`` takes two."""
        if self._pair is None or self._buffer is None:
            raise RuntimeError(f"{self.spec.key!r}: call prepare_add_ones() at attach first")
        self._buffer.index_add_(0, self._pair, self._gate.expand(2), alpha=n)

    def update(self, value: torch.Tensor) -> None:
        """Max and min metrics: fold ``value`` into the running extreme."""
        if self._max is None:
            if self.spec.agg in ("mean", "sum"):
                raise TypeError(f"metric {self.spec.key!r} is a {self.spec.agg} metric: use add()")
            raise self._unbound()
        if self.spec.agg == "min":
            value = -value
        # where(), not value + (0 | -inf): a NaN would survive the addition while
        # recording is off. A Python -inf keeps the value's dtype (a float64 tensor
        # there would launch a cast kernel first).
        self._max.clamp_(min=torch.where(self._gate_on, value, -torch.inf))

    def record(self, value: torch.Tensor, count: int | torch.Tensor = 1) -> None:
        """``add`` for mean/sum metrics, ``update`` for max/min metrics."""
        if self.spec.agg in ("max", "min"):
            self.update(value)
        else:
            self.add(value, count)
