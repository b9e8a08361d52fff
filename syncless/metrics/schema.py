"""What a metric is, declared once at registration.

A metric has an area, a name with its unit suffix, an aggregation and a length
(1 for a scalar; n for a per-head, per-expert or per-channel vector). A layer metric
is declared per layer (scope ``layer_03``); its global over layers (scope ``global``)
is derived at flush from the per-layer accumulators, never written twice on the hot
path.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from syncless.run.records import check_metric_name

Agg = Literal["mean", "sum", "max", "min"]
AGGS: tuple[str, ...] = ("mean", "sum", "max", "min")


def layer_scope(layer: int) -> str:
    return f"layer_{layer:02d}"


@dataclass(frozen=True)
class MetricSpec:
    """One declared metric.

    ``element`` names the elements of a vector metric (``"head"`` gives records
    ``.../qk_logit_max/head_05``); ``emit_elements=False`` keeps a long vector (per
    channel) out of the step records while its summary and the array stay available.
    ``derive_global=False`` skips the over-layers global (for intermediate values such
    as sums of squares that only mean something after the monitor derives from them).
    """

    area: str
    name: str
    agg: Agg
    size: int = 1
    layer: int | None = None
    element: str = "i"
    emit_elements: bool = True
    derive_global: bool = True

    def __post_init__(self) -> None:
        if self.agg not in AGGS:
            raise ValueError(
                f"metric {self.area}/{self.name}: unknown aggregation {self.agg!r}; "
                f"expected one of {', '.join(AGGS)}"
            )
        if self.size < 1:
            raise ValueError(f"metric {self.area}/{self.name}: size must be >= 1, got {self.size}")
        check_metric_name(self.key)

    @property
    def scope(self) -> str:
        return "step" if self.layer is None else layer_scope(self.layer)

    @property
    def key(self) -> str:
        return f"{self.area}/{self.scope}/{self.name}"

    @property
    def global_key(self) -> str | None:
        """The derived over-layers key of a layer metric (None: not derived)."""
        if self.layer is None or not self.derive_global:
            return None
        return f"{self.area}/global/{self.name}"

    @property
    def definition(self) -> tuple:
        """What must agree across ranks for the same key."""
        return (self.agg, self.size, self.element, self.emit_elements, self.derive_global)


def schema_digest(specs: list[MetricSpec]) -> str:
    text = "\n".join(f"{s.key}|{s.definition}" for s in specs)
    return hashlib.sha256(text.encode()).hexdigest()
