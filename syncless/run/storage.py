"""Where a run directory's files live: a local folder, or a prefix in an object store.

A run directory named by a URL (``s3://bucket/runs/x``, ``gs://...``: any fsspec
protocol but ``file``) is a ``upath.UPath`` (universal_pathlib: pathlib's methods over
fsspec); any other stays a :class:`pathlib.Path`. Code that joins, names and reads
paths treats both alike. What differs is here, each with the guarantee it keeps:

- **A file appears whole or not at all.** Locally it is written under a temporary
  name and renamed (syncless.run.atomic). In an object store one PUT, or a multipart
  upload completed at its end, is already atomic, and a rename would be a copy and a
  delete: the bytes are built in memory and put once (a metric shard is a few MB).
- **A listing is fresh.** fsspec keeps an object store's listings per filesystem
  object; a reader of a live run must see the shards written since, so every listing
  here asks the store again.
- **Exclusive creation** (``run.json``, a compaction lock): ``O_EXCL``/``link``
  locally; a conditional PUT (``If-None-Match: *``) on S3 through s3fs's
  ``mode="create"``; a check, then a PUT on a filesystem without one (fsspec's own
  fallback: two writers in the same instant could both win).
- **pyarrow reads through the filesystem object**, not a local name.

Credentials and endpoints are the filesystem's: environment variables (``AWS_*``,
``FSSPEC_S3_ENDPOINT_URL``), fsspec's config file, or a ``UPath`` made by the caller
with its storage options (``Run(run_dir=UPath("s3://b/x", endpoint_url=...))``).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from syncless.errors import UsageError
from syncless.run.atomic import replaced_when_written

if TYPE_CHECKING:
    from typing import TypeAlias

    import pyarrow as pa
    import pyarrow.parquet as pq
    from upath import UPath

    RunPath: TypeAlias = Path | UPath
else:
    RunPath = Path

__all__ = [
    "RunPath",
    "is_remote",
    "list_files",
    "read_metadata",
    "read_table",
    "remove",
    "run_path",
    "write_exclusive",
    "write_parquet",
    "write_whole",
]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def run_path(path: str | os.PathLike) -> RunPath:
    """``path`` as a :class:`~pathlib.Path`, or as a ``UPath`` when it is a URL.

    A ``UPath`` passes through as it is (with the storage options it was made with);
    ``file://`` URLs are local paths.
    """
    if is_remote(path):
        return path  # type: ignore[return-value]
    if not isinstance(path, (str, Path)) and hasattr(path, "protocol"):  # a local UPath
        return Path(path.path)
    text = os.fspath(path)
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    if not _URL.match(text):
        return Path(text)
    try:
        from upath import UPath
    except ImportError:
        raise UsageError(
            f"{text!r} is a URL: a run directory in an object store needs "
            'pip install "syncless[fsspec]" and the filesystem\'s package (s3fs for s3://, '
            "gcsfs for gs://)"
        ) from None
    try:
        return UPath(text)
    except (ValueError, ImportError) as e:  # fsspec knows no such protocol, or lacks its package
        raise UsageError(f"cannot open {text!r}: {e}") from None


def is_remote(path: object) -> bool:
    """Whether ``path`` lives in an object store (a ``UPath`` that is not local)."""
    if isinstance(path, (str, Path)) or not hasattr(path, "fs"):
        return False
    return getattr(path, "protocol", "") not in ("", "file", "local")


def list_files(folder: RunPath, prefix: str = "") -> list[str]:
    """The names of the files directly in ``folder`` that start with ``prefix``, as the
    store holds them now ([] for a folder that does not exist)."""
    if not is_remote(folder):
        try:
            with os.scandir(folder) as entries:  # the kind from the listing: no stat a file
                return [e.name for e in entries if e.name.startswith(prefix) and e.is_file()]
        except FileNotFoundError:
            return []
    try:
        entries = folder.fs.ls(folder.path, detail=True, refresh=True)
    except FileNotFoundError:
        return []
    names = (e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "file")
    return [n for n in names if n.startswith(prefix)]


def write_whole(final: RunPath, data: bytes) -> None:
    """Write ``data`` to ``final`` so that a reader sees all of it or none."""
    if is_remote(final):
        final.fs.pipe_file(final.path, data)
        return
    with replaced_when_written(final) as tmp:
        tmp.write_bytes(data)


def write_exclusive(final: RunPath, data: bytes) -> None:
    """Create ``final`` holding ``data``, whole; FileExistsError if it exists already."""
    if is_remote(final):
        final.fs.pipe_file(final.path, data, mode="create")
        return
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        try:
            os.link(tmp, final)  # a link never replaces: the exclusive step
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: a rename, not exclusive
            os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)  # a full disk needs its space back


def write_parquet(table: pa.Table, final: RunPath, **options: Any) -> None:
    """Write ``table`` as the Parquet file ``final``, whole or not at all."""
    import pyarrow as pa  # here, not at import: a query reads no file through pyarrow
    import pyarrow.parquet as pq

    if is_remote(final):
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer, **options)
        final.fs.pipe_file(final.path, buffer.getvalue().to_pybytes())
        return
    with replaced_when_written(final) as tmp:
        pq.write_table(table, tmp, **options)


def read_metadata(path: RunPath) -> pq.FileMetaData:
    """The Parquet footer of ``path``."""
    import pyarrow.parquet as pq

    if is_remote(path):
        return pq.read_metadata(path.path, filesystem=path.fs)
    return pq.read_metadata(path)


def read_table(path: RunPath, **options: Any) -> pa.Table:
    import pyarrow.parquet as pq

    if is_remote(path):
        return pq.read_table(path.path, filesystem=path.fs, **options)
    return pq.read_table(path, **options)


def exists(path: RunPath) -> bool:
    """Whether ``path`` exists now (an object store is asked again, not its cache)."""
    if is_remote(path):
        path.fs.invalidate_cache(path.parent.path)
    return path.exists()


def remove(path: RunPath) -> None:
    """Delete the file ``path``; one that is gone already is no error."""
    if not is_remote(path):
        path.unlink(missing_ok=True)
        return
    with contextlib.suppress(FileNotFoundError):
        path.fs.rm_file(path.path)
