"""Where captured tensors go, and reading them back.

- ``shards``: the on-disk layout (safetensors shards plus a Parquet index per rank),
  :class:`CapturedRecord`, the :class:`CaptureSink` protocol, :class:`SafetensorsSink`
  and :class:`MemorySink`;
- ``fsspec``: :class:`FsspecSink`, the same files at an fsspec URL (S3, GCS, ...);
- ``reader``: :func:`open` a run directory or URL, :class:`CaptureStore`.
"""

from __future__ import annotations

from syncless.capture.sinks.fsspec import FsspecSink
from syncless.capture.sinks.reader import CaptureStore, open
from syncless.capture.sinks.shards import (
    CAPTURES_DIR,
    INDEX_SCHEMA,
    CapturedRecord,
    CaptureSink,
    MemorySink,
    SafetensorsSink,
    ShardNumbers,
    dtype_name,
    shard_stem,
)

__all__ = [
    "CAPTURES_DIR",
    "INDEX_SCHEMA",
    "CaptureSink",
    "CaptureStore",
    "CapturedRecord",
    "FsspecSink",
    "MemorySink",
    "SafetensorsSink",
    "ShardNumbers",
    "dtype_name",
    "open",
    "shard_stem",
]
