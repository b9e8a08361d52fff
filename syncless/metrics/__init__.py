"""The GPU-buffer metric core: declare at registration, record in hooks, flush per step."""

from syncless.metrics.consensus import SchemaMismatch
from syncless.metrics.metric_set import Landed, MetricSet
from syncless.metrics.readout import Readout
from syncless.metrics.schema import AGGS, Agg, MetricSpec, layer_scope
from syncless.metrics.slot import Slot

__all__ = [
    "AGGS",
    "Agg",
    "Landed",
    "MetricSet",
    "MetricSpec",
    "Readout",
    "SchemaMismatch",
    "Slot",
    "layer_scope",
]
