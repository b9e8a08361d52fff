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
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from syncless.capture.sink import CAPTURES_DIR, INDEX_SCHEMA
from syncless.errors import UsageError

__all__ = ["CaptureStore", "open"]


class CaptureStore:
    """The captures of a run directory (all ranks), opened for reading.

    Args:
        path: a run directory (with a ``captures/`` folder) or the ``captures/``
            folder itself.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        if not path.is_dir():
            raise UsageError(f"{str(path)!r} does not exist or is not a directory")
        if (path / CAPTURES_DIR).is_dir():
            self.dir = path / CAPTURES_DIR
        elif path.name == CAPTURES_DIR or any(path.glob("rank*-*.parquet")):
            self.dir = path
        else:
            raise UsageError(
                f"{str(path)!r} has no captures: expected a {CAPTURES_DIR}/ folder with "
                f"rank*.parquet index files (written by a CaptureEngine's SafetensorsSink)"
            )
        files = sorted(self.dir.glob("rank*-*.parquet"))
        tables = [pq.read_table(f, schema=INDEX_SCHEMA) for f in files]
        index = pa.concat_tables(tables) if tables else INDEX_SCHEMA.empty_table()
        #: One row per captured tensor, sorted by (rank, seq).
        self.index: pa.Table = index.sort_by([("rank", "ascending"), ("seq", "ascending")])
        self._rows: list[dict[str, Any]] | None = None

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
            with builtins.open(self.dir / row["file"], "rb") as f:
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


def open(path: str | os.PathLike[str]) -> CaptureStore:
    """Open a run directory's captures: ``syncless.capture.open("runs/...")``."""
    return CaptureStore(path)
