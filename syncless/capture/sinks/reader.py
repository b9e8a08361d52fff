"""Reading captures back: ``syncless.capture.open(run_dir)``.

The index is every rank's Parquet index files concatenated, sorted by ``(rank, seq)``
(capture order on each rank). A tensor is read from its shard at the index's byte
offset, so reading one tensor does not parse or load the rest of its shard.

    store = syncless.capture.open("runs/20261130-120000-demo")
    store.index  # pyarrow Table: rank, seq, tag, step, shape, dtype, file, ...
    for i in store.select(tag="layer_03/hidden", step=100):
        x = store.tensor(i)
"""

from __future__ import annotations

import builtins
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from syncless.capture.sinks.shards import CAPTURES_DIR, INDEX_SCHEMA
from syncless.errors import UsageError

__all__ = ["CaptureStore", "open"]


class CaptureStore:
    """The captures of a run directory (all ranks), opened for reading.

    Args:
        path: a run directory (with a ``captures/`` folder) or the ``captures/``
            folder itself, local or an fsspec URL (``s3://bucket/run-7/captures``).
        storage_options: keyword arguments for a URL's filesystem (credentials,
            endpoint).
    """

    def __init__(
        self, path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
    ) -> None:
        self._fs: Any = None  # an fsspec filesystem when ``path`` is a URL
        self.dir: Path | str  # the captures folder (a path within ``_fs`` for a URL)
        if isinstance(path, str) and "://" in path:
            self._fs, self.dir = _locate_url(path, storage_options)
            files = sorted(self._fs.glob(f"{self.dir}/rank*-*.parquet"))
        else:
            self.dir = _locate_dir(Path(path))
            files = sorted(self.dir.glob("rank*-*.parquet"))
        tables = []
        for name in files:
            with self._open(name) as f:
                tables.append(pq.read_table(f, schema=INDEX_SCHEMA))
        index = pa.concat_tables(tables) if tables else INDEX_SCHEMA.empty_table()
        #: One row per captured tensor, sorted by (rank, seq).
        self.index: pa.Table = index.sort_by([("rank", "ascending"), ("seq", "ascending")])
        self._rows: list[dict[str, Any]] | None = None

    def _open(self, path: str | os.PathLike[str]) -> IO[bytes]:
        return builtins.open(path, "rb") if self._fs is None else self._fs.open(path, "rb")

    def __len__(self) -> int:
        return self.index.num_rows

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The index as a list of dicts (built once)."""
        if self._rows is None:
            self._rows = self.index.to_pylist()
        return self._rows

    def tags(self) -> list[str]:
        """The distinct tags, sorted."""
        return sorted(set(self.index.column("tag").to_pylist()))

    def select(
        self, tag: str | None = None, step: int | None = None, rank: int | None = None
    ) -> list[int]:
        """Row numbers matching every filter given, in index order."""
        mask = None
        for column, value in (("tag", tag), ("step", step), ("rank", rank)):
            if value is None:
                continue
            hit = pc.equal(self.index.column(column), value)
            mask = hit if mask is None else pc.and_(mask, hit)
        if mask is None:
            return list(range(len(self)))
        return [i for i, keep in enumerate(pc.fill_null(mask, False).to_pylist()) if keep]

    def meta(self, i: int) -> Any:
        """Row ``i``'s meta, parsed (None if the capture gave none)."""
        text = self.rows[i]["meta"]
        return None if text is None else json.loads(text)

    def tensor(self, i: int) -> torch.Tensor:
        """Row ``i``'s tensor, as captured (dtype and shape), read from its shard."""
        row = self.rows[i]
        dtype = getattr(torch, row["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise UsageError(f"row {i}: unknown dtype {row['dtype']!r} (a newer torch wrote it?)")
        shape, nbytes = tuple(row["shape"]), row["nbytes"]
        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            with self._open(f"{self.dir}/{row['file']}") as f:
                f.seek(row["offset"])
                got = f.readinto(memoryview(out.numpy()))
            if got != nbytes:
                raise UsageError(
                    f"row {i}: {row['file']} ends after {got} of {nbytes} bytes at offset "
                    f"{row['offset']} (truncated file?)"
                )
        return out.view(dtype).view(shape)

    def tensors(
        self, tag: str | None = None, step: int | None = None, rank: int | None = None
    ) -> list[torch.Tensor]:
        """The tensors of :meth:`select`, in index order."""
        return [self.tensor(i) for i in self.select(tag, step, rank)]

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        """``(row, tensor)`` for every captured tensor, in index order."""
        for i, row in enumerate(self.rows):
            yield row, self.tensor(i)


def open(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> CaptureStore:
    """Open a run directory's captures: ``syncless.capture.open("runs/...")``.

    ``path`` may also be an fsspec URL (``s3://bucket/run-7/captures``, what an
    ``FsspecSink`` wrote); ``storage_options`` go to its filesystem.
    """
    return CaptureStore(path, storage_options)


def _locate_dir(path: Path) -> Path:
    if not path.is_dir():
        raise UsageError(f"{str(path)!r} does not exist or is not a directory")
    if (path / CAPTURES_DIR).is_dir():
        return path / CAPTURES_DIR
    if path.name == CAPTURES_DIR or any(path.glob("rank*-*.parquet")):
        return path
    raise UsageError(
        f"{str(path)!r} has no captures: expected a {CAPTURES_DIR}/ folder with "
        f"rank*.parquet index files (written by a CaptureEngine's SafetensorsSink)"
    )


def _locate_url(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """The filesystem and folder of a URL's captures: the URL itself or its captures/."""
    from syncless.capture.sinks.fsspec import url_filesystem

    fs, root = url_filesystem(url, storage_options)
    root = root.rstrip("/")
    fs.invalidate_cache(root)  # another process may have written since the last listing
    if fs.glob(f"{root}/rank*-*.parquet"):
        return fs, root
    if fs.glob(f"{root}/{CAPTURES_DIR}/rank*-*.parquet"):
        return fs, f"{root}/{CAPTURES_DIR}"
    raise UsageError(
        f"{url!r} has no captures: expected rank*.parquet index files there or in its "
        f"{CAPTURES_DIR}/ folder (written by an FsspecSink)"
    )
