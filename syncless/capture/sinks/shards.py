"""Where captured tensors go: safetensors shards plus a Parquet index in the run directory.

Layout (one pair of files per shard, per rank)::

    <run_dir>/captures/
        rank00000-000001.safetensors    the tensors of one shard (safetensors format)
        rank00000-000001.parquet        their index: one row per tensor

Each file is written under a hidden temporary name and renamed into place, the
safetensors file first: an index file exists only once its tensors are complete, so a
reader that globs the index never sees a partial shard (the rename is atomic on POSIX
file systems), whatever killed the writer. Reopening a run directory continues the
shard numbering.

Index columns: ``rank``, ``seq`` (the record's number on its rank, in capture order),
``tag``, ``step`` (null when not given), ``shape``, ``dtype`` (torch's name, e.g.
``bfloat16``), ``file`` (relative to ``captures/``), ``key`` (the tensor's name in
the file), ``offset`` (byte offset of its data in the file), ``nbytes``, ``meta``
(JSON text or null).

The shard is written by this module rather than by ``safetensors.torch.save_file``:
the data goes to disk straight from the pinned staging memory (no copy into a bytes
object first), and the format is a JSON header and the raw bytes. Any safetensors
reader loads the shards. Dtypes safetensors has no code for (``complex128``, the
sub-byte and ``float8_e8m0fnu`` types, ...) are stored as their raw bytes (``U8``,
shape ``[nbytes]``); the index keeps their real dtype and shape, and
:func:`syncless.capture.open` reads them back typed.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from syncless.run.atomic import replaced_when_written

__all__ = [
    "CAPTURES_DIR",
    "INDEX_SCHEMA",
    "CaptureSink",
    "CapturedRecord",
    "MemorySink",
    "SafetensorsSink",
    "ShardNumbers",
    "dtype_name",
    "shard_stem",
]

CAPTURES_DIR = "captures"
FORMAT = "syncless-capture/1"

INDEX_SCHEMA = pa.schema(
    [
        ("rank", pa.int32()),
        ("seq", pa.int64()),
        ("tag", pa.string()),
        ("step", pa.int64()),
        ("shape", pa.list_(pa.int64())),
        ("dtype", pa.string()),
        ("file", pa.string()),
        ("key", pa.string()),
        ("offset", pa.int64()),
        ("nbytes", pa.int64()),
        ("meta", pa.string()),
    ]
)

# torch dtype -> safetensors dtype code (the codes of the format's specification).
_SAFETENSORS_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
):
    if hasattr(torch, _name):
        _SAFETENSORS_CODES[getattr(torch, _name)] = _code


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (``getattr(torch, name)`` gives it back)."""
    return str(dtype).removeprefix("torch.")


class CapturedRecord(NamedTuple):
    """One captured tensor on its way to a sink.

    ``data`` is its raw bytes (uint8, 1-D, ``nbytes`` long), usually a view into the
    engine's pinned staging ring: valid only during the ``write`` call it is passed to.
    A sink that keeps a record past that call must copy it (``record.tensor().clone()``).
    """

    seq: int
    tag: str
    step: int | None
    rank: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    meta: str | None  # JSON text
    data: torch.Tensor

    def tensor(self) -> torch.Tensor:
        """The record as the captured dtype and shape (a zero-copy view of ``data``)."""
        return self.data.view(self.dtype).view(self.shape)


@runtime_checkable
class CaptureSink(Protocol):
    """A destination for captured tensors.

    ``write`` runs on the engine's writer threads, never on the training thread, once per
    shard (a batch of records in capture order). An exception from it is counted: its
    records are dropped with reason ``sink_error`` and training goes on (the engine's
    ``strict=True`` raises it on the training thread instead).

    With ``writers > 1`` the engine calls ``write`` from several threads at once, so
    shards may finish out of order. A sink must be safe for that, or declare
    ``concurrent_writes = False`` as a class attribute: then one thread writes
    whatever was asked.
    """

    def write(self, records: Sequence[CapturedRecord]) -> None: ...

    def close(self) -> None: ...


class ShardNumbers:
    """Shard numbers for a sink whose ``write`` runs on several writer threads at once:
    each write takes the next number under a lock, and one that fails gives it back
    when no later write has taken one (so a single writer never leaves a gap).

        with self._numbers.take() as seq:
            write_files(shard_stem(rank, seq), records)
    """

    def __init__(self, first: int) -> None:
        self._next = first
        self._lock = threading.Lock()
        self.written = 0

    @contextlib.contextmanager
    def take(self) -> Iterator[int]:
        with self._lock:
            seq, self._next = self._next, self._next + 1
        try:
            yield seq
        except BaseException:
            with self._lock:
                if self._next == seq + 1:
                    self._next = seq
            raise
        with self._lock:
            self.written += 1


def shard_stem(rank: int, seq: int) -> str:
    """The file name of shard ``seq`` of ``rank``, without its suffix."""
    return f"rank{rank:05d}-{seq:06d}"


class SafetensorsSink:
    """One safetensors shard plus one Parquet index file per ``write``.

    Args:
        run_dir: the run directory; files go to ``<run_dir>/captures/``.
        rank: this process's rank (part of every file name).
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int = 0) -> None:
        self.dir = Path(run_dir) / CAPTURES_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._numbers = ShardNumbers(self._next_free_seq())

    @property
    def shards_written(self) -> int:
        return self._numbers.written

    def write(self, records: Sequence[CapturedRecord]) -> None:
        if records:
            with self._numbers.take() as seq:
                self._write_shard(shard_stem(self.rank, seq), records)

    def _next_free_seq(self) -> int:
        # Resuming into an existing run directory must not overwrite earlier shards.
        names = self.dir.glob(f"rank{self.rank:05d}-*.safetensors")
        return max((int(p.stem.rsplit("-", 1)[1]) for p in names), default=0) + 1

    def _write_shard(self, stem: str, records: Sequence[CapturedRecord]) -> None:
        header, keys = shard_header(records, self.rank)
        data_start = 8 + len(header)
        with replaced_when_written(self.dir / f"{stem}.safetensors") as tmp, open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for r in records:
                if r.nbytes:
                    f.write(memoryview(r.data.numpy()))
        try:
            table = index_table(records, f"{stem}.safetensors", keys, data_start)
            with replaced_when_written(self.dir / f"{stem}.parquet") as tmp:
                pq.write_table(table, tmp)
        except BaseException:
            # Its records are counted as dropped: the shard must not hold disk either.
            (self.dir / f"{stem}.safetensors").unlink(missing_ok=True)
            raise

    def close(self) -> None:
        pass


def shard_header(records: Sequence[CapturedRecord], rank: int) -> tuple[bytes, list[str]]:
    """The safetensors JSON header (space-padded to 8 bytes, as the format allows) and
    the tensor names, which are the records' sequence numbers."""
    entries: dict[str, object] = {"__metadata__": {"format": FORMAT, "rank": str(rank)}}
    keys = []
    pos = 0
    for r in records:
        key = f"{r.seq:012d}"
        code = _SAFETENSORS_CODES.get(r.dtype)
        shape = list(r.shape) if code is not None else [r.nbytes]
        entries[key] = {
            "dtype": code or "U8",
            "shape": shape,
            "data_offsets": [pos, pos + r.nbytes],
        }
        keys.append(key)
        pos += r.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8), keys


def index_table(
    records: Sequence[CapturedRecord], file: str, keys: Sequence[str], data_start: int
) -> pa.Table:
    """The index rows of one shard: ``file`` is its name, ``data_start`` where its data
    begins (after the header)."""
    offsets, pos = [], data_start
    for r in records:
        offsets.append(pos)
        pos += r.nbytes
    return pa.table(
        {
            "rank": [r.rank for r in records],
            "seq": [r.seq for r in records],
            "tag": [r.tag for r in records],
            "step": [r.step for r in records],
            "shape": [list(r.shape) for r in records],
            "dtype": [dtype_name(r.dtype) for r in records],
            "file": [file] * len(records),
            "key": list(keys),
            "offset": offsets,
            "nbytes": [r.nbytes for r in records],
            "meta": [r.meta for r in records],
        },
        schema=INDEX_SCHEMA,
    )


class MemorySink:
    """Keeps a copy of every record in memory (tests, notebooks, small captures)."""

    concurrent_writes = False  # one write at a time keeps ``records`` in capture order

    def __init__(self) -> None:
        self.records: list[CapturedRecord] = []
        self.writes = 0
        self.closed = False

    def write(self, records: Sequence[CapturedRecord]) -> None:
        self.writes += 1
        self.records.extend(r._replace(data=_owned_copy(r.data)) for r in records)

    def close(self) -> None:
        self.closed = True

    def tensors(self, tag: str | None = None) -> list[torch.Tensor]:
        return [r.tensor() for r in self.records if tag is None or r.tag == tag]


def _owned_copy(data: torch.Tensor) -> torch.Tensor:
    """``data``'s bytes in memory of their own, copied without a torch op: on a writer
    thread a CPU op starts an OpenMP team that competes with training's (docs/capture.md:
    "On the CPU the engine's threads must not run torch ops")."""
    if data.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(memoryview(data.numpy())), dtype=torch.uint8)
