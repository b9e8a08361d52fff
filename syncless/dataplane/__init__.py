"""Observability for key-value tensor transfer clients: cost per op and per step,
across ranks, and whether the bytes arrived intact. See docs/dataplane.md."""

from syncless.dataplane.backends.memory import InMemoryStore
from syncless.dataplane.bytes import msgpack_size, payload_nbytes, tensor_nbytes
from syncless.dataplane.client import KVClient
from syncless.dataplane.histogram import LogHistogram
from syncless.dataplane.integrity import row_digests, verify_rows
from syncless.dataplane.metrics_client import MetricsClient, cluster_step

__all__ = [
    "InMemoryStore",
    "KVClient",
    "LogHistogram",
    "MetricsClient",
    "cluster_step",
    "msgpack_size",
    "payload_nbytes",
    "row_digests",
    "tensor_nbytes",
    "verify_rows",
]
