"""``FsspecSink``: the safetensors sink's layout on any fsspec filesystem (S3, GCS, ...).

The files, their names and the index columns are those of
:class:`~syncless.capture.sinks.shards.SafetensorsSink`; only where they go differs.
``syncless.capture.open(url)`` reads them back. Needs ``pip install "syncless[fsspec]"``,
plus the filesystem's own package (``s3fs`` for ``s3://``).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence
from typing import Any

import pyarrow.parquet as pq

from syncless.capture.sinks.shards import (
    CapturedRecord,
    ShardNumbers,
    index_table,
    shard_header,
    shard_stem,
)
from syncless.errors import UsageError

__all__ = ["FsspecSink"]

# Records are handed to the file object in slices of this size. fsspec's buffered files
# (s3fs, gcsfs) copy each write into their buffer and upload a part once it reaches
# their block size, so a slice bounds the extra memory a large record costs.
WRITE_CHUNK_BYTES = 8 << 20


def url_filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path within it. fsspec is imported here,
    so that ``syncless.capture`` works without it."""
    try:
        import fsspec
    except ImportError as e:
        raise UsageError(
            f'{url!r} needs fsspec: pip install "syncless[fsspec]" (and s3fs for s3://)'
        ) from e
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def _renames_atomically(fs: Any) -> bool:
    # Only the local filesystem's move is a rename. On object stores a move is a copy and
    # a delete, while a plain write already appears whole when its file closes.
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


class FsspecSink:
    """One safetensors shard plus one Parquet index object per ``write``, at a URL.

    The URL is the folder that gets the files, the equivalent of ``<run_dir>/captures``.
    Each ``write`` streams the records from staging memory into the shard's file object
    and writes the index last: readers find shards through the index, and an object
    store shows an object only once it is complete. On ``file://`` both files are
    written under a hidden temporary name and renamed, as ``SafetensorsSink`` does.
    A sink at a URL that already holds this rank's shards continues their numbering.

        sink = FsspecSink("s3://bucket/run-7/captures", rank=0)
        engine = CaptureEngine(ring_bytes=1 << 30, staging_bytes=256 << 20, sink=sink)
        ...
        store = syncless.capture.open("s3://bucket/run-7/captures")

    Args:
        url: an fsspec URL: ``s3://bucket/prefix``, ``file:///data/captures``,
            ``memory://captures``.
        rank: this process's rank (part of every file name).
        storage_options: keyword arguments for the filesystem (credentials, endpoint).
    """

    def __init__(
        self, url: str, rank: int = 0, storage_options: dict[str, Any] | None = None
    ) -> None:
        self.url = url
        self.fs, self.dir = url_filesystem(url, storage_options)
        self.dir = self.dir.rstrip("/")
        self.fs.makedirs(self.dir, exist_ok=True)
        self.rank = rank
        self._rename = _renames_atomically(self.fs)
        self._numbers = ShardNumbers(self._next_free_seq())

    @property
    def shards_written(self) -> int:
        return self._numbers.written

    def write(self, records: Sequence[CapturedRecord]) -> None:
        if records:
            with self._numbers.take() as seq:
                self._write_shard(shard_stem(self.rank, seq), records)

    def _next_free_seq(self) -> int:
        # Resuming at a URL must not overwrite earlier shards. Listings may be cached
        # (s3fs keeps them per filesystem instance), so look again.
        self.fs.invalidate_cache(self.dir)
        names = self.fs.glob(f"{self.dir}/rank{self.rank:05d}-*.safetensors")
        stems = (name.rsplit("/", 1)[-1].removesuffix(".safetensors") for name in names)
        return max((int(stem.rsplit("-", 1)[1]) for stem in stems), default=0) + 1

    def _write_shard(self, stem: str, records: Sequence[CapturedRecord]) -> None:
        header, keys = shard_header(records, self.rank)
        with self._create(f"{stem}.safetensors") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for r in records:
                view = memoryview(r.data.numpy())
                for start in range(0, r.nbytes, WRITE_CHUNK_BYTES):
                    f.write(view[start : start + WRITE_CHUNK_BYTES])
        table = index_table(records, f"{stem}.safetensors", keys, 8 + len(header))
        with self._create(f"{stem}.parquet") as f:
            pq.write_table(table, f)

    def _create(self, name: str) -> _NewFile:
        final = f"{self.dir}/{name}"
        temporary = f"{self.dir}/.{name}.tmp" if self._rename else None
        return _NewFile(self.fs, final, temporary)

    def close(self) -> None:
        pass


class _NewFile:
    """A file opened for writing that takes its final name on a clean exit.

    With ``temporary`` set, the data goes there and is moved to ``final`` afterwards.
    A failed write leaves no file under the final name where the filesystem renames,
    and on object stores an aborted upload leaves no object.
    """

    def __init__(self, fs: Any, final: str, temporary: str | None) -> None:
        self.fs, self.final, self.temporary = fs, final, temporary
        self.file: Any = None

    def __enter__(self) -> Any:
        self.file = self.fs.open(self.temporary or self.final, "wb")
        return self.file

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:
            self.file.close()
            if self.temporary is not None:
                self.fs.mv(self.temporary, self.final)
            return
        self._abandon()

    def _abandon(self) -> None:
        from fsspec.spec import AbstractBufferedFile

        if self.temporary is None and isinstance(self.file, AbstractBufferedFile):
            # close() would complete a multipart upload and publish a partial object.
            # discard() aborts it (s3fs), and the file must not flush again later.
            self.file.discard()
            self.file.closed = True
        else:
            self.file.close()
        # Some filesystems show a file from its open (memory://): take it back. The
        # original error matters more than a failed clean-up.
        with contextlib.suppress(OSError):
            self.fs.rm(self.temporary or self.final)
