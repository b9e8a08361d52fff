"""FsspecSink on memory://, file:// and (when moto and s3fs are installed) S3, read back."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from moto_s3 import moto_s3

from syncless.capture import CapturedRecord, FsspecSink, SafetensorsSink
from syncless.capture import open as open_captures
from syncless.errors import UsageError

fsspec = pytest.importorskip("fsspec")


def record(seq: int, tensor: torch.Tensor, tag: str, step: int | None = 3) -> CapturedRecord:
    t = tensor.contiguous()
    data = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    meta = None if seq % 2 else f'{{"seq": {seq}}}'
    return CapturedRecord(seq, tag, step, 0, tuple(t.shape), t.dtype, data.numel(), meta, data)


def originals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "f32": torch.randn(4, 2, 3, generator=g),
        "i8": torch.randint(-128, 127, (7,), dtype=torch.int8, generator=g),
        "empty": torch.empty(0, 4, dtype=torch.float32),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }


def records(first_seq: int = 0) -> list[CapturedRecord]:
    return [record(first_seq + i, x, tag) for i, (tag, x) in enumerate(originals().items())]


@pytest.fixture
def memory_url() -> Iterator[str]:
    # memory:// is one store per process: give each test its own folder and clear it.
    folder = f"/syncless-test-{uuid.uuid4().hex}"
    yield f"memory://{folder}/captures"
    fs = fsspec.filesystem("memory")
    if fs.exists(folder):
        fs.rm(folder, recursive=True)


@pytest.fixture(params=["memory", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return request.getfixturevalue("memory_url")
    return f"file://{tmp_path}/run/captures"


def names(url: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(url)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def test_records_of_several_dtypes_read_back_byte_exact(url: str) -> None:
    sink = FsspecSink(url, rank=0)
    sink.write(records())
    sink.close()

    store = open_captures(url)
    assert len(store) == len(originals())
    for (tag, x), (row, y) in zip(originals().items(), store, strict=True):
        assert row["tag"] == tag
        assert y.dtype == x.dtype and y.shape == x.shape
        assert torch.equal(y, x)
    assert store.meta(0) == {"seq": 0} and store.meta(1) is None


def test_files_and_index_equal_what_the_safetensors_sink_writes(url: str, tmp_path: Path) -> None:
    FsspecSink(url, rank=2).write([r._replace(rank=2) for r in records()])
    SafetensorsSink(tmp_path / "local", rank=2).write([r._replace(rank=2) for r in records()])
    local = tmp_path / "local" / "captures"

    assert names(url) == sorted(p.name for p in local.iterdir())
    assert names(url) == ["rank00002-000001.parquet", "rank00002-000001.safetensors"]
    fs, path = fsspec.core.url_to_fs(url)
    with fs.open(f"{path}/rank00002-000001.parquet", "rb") as f:
        remote_index = pq.read_table(f)
    # Equal in every column: ``file`` is relative to the captures folder in both.
    assert remote_index.equals(pq.read_table(local / "rank00002-000001.parquet"))
    shard = fs.cat_file(f"{path}/rank00002-000001.safetensors")
    assert shard == (local / "rank00002-000001.safetensors").read_bytes()


def test_a_second_sink_continues_the_numbering(url: str) -> None:
    FsspecSink(url).write(records(0))
    FsspecSink(url, rank=1).write([r._replace(rank=1) for r in records(0)])
    again = FsspecSink(url)
    again.write(records(5))
    again.write(records(10))
    assert names(url) == [
        f"rank0000{rank}-00000{shard}.{ext}"
        for rank, shard in ((0, 1), (0, 2), (0, 3), (1, 1))
        for ext in ("parquet", "safetensors")
    ]
    store = open_captures(url)
    assert [(r["rank"], r["seq"]) for r in store.rows] == [
        (rank, seq) for rank, seqs in ((0, range(15)), (1, range(5))) for seq in seqs
    ]


def test_open_finds_the_captures_folder_under_a_run_url(url: str) -> None:
    FsspecSink(url).write(records())
    run_url = url.removesuffix("/captures")
    assert len(open_captures(run_url)) == len(originals())
    with pytest.raises(UsageError, match="has no captures"):
        open_captures(f"{run_url}/elsewhere")


class Unreadable:
    """A record's data that fails while the shard is being written."""

    def numpy(self) -> None:
        raise RuntimeError("staging memory gone")


def test_a_failed_write_leaves_no_file_behind(url: str) -> None:
    sink = FsspecSink(url)
    sink.write(records())
    bad = records(5)
    bad[2] = bad[2]._replace(data=Unreadable())
    with pytest.raises(RuntimeError, match="staging memory gone"):
        sink.write(bad)
    # Neither the shard nor a temporary file is left; the number is used by the next write.
    assert names(url) == ["rank00000-000001.parquet", "rank00000-000001.safetensors"]
    sink.write(records(5))
    assert len(open_captures(url)) == 2 * len(originals())


def test_a_url_without_fsspec_installed_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(UsageError, match=r'pip install "syncless\[fsspec\]"'):
        FsspecSink("memory://nowhere")


# ---- S3, against moto's local server ----------------------------------------------


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[dict, str]]:
    """storage_options for s3fs against a moto server on a free local port, and a bucket."""
    with moto_s3(monkeypatch, prefix="captures") as server:
        yield server.options, server.bucket


def test_s3_shards_read_back_byte_exact_and_numbering_continues(s3: tuple[dict, str]) -> None:
    options, bucket = s3
    url = f"s3://{bucket}/run-7/captures"
    big = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: a multipart upload
    first = [*records(), record(5, big, "big")]
    FsspecSink(url, storage_options=options).write(first)
    FsspecSink(url, storage_options=options).write(records(6))

    store = open_captures(f"s3://{bucket}/run-7", storage_options=options)
    assert [r["file"] for r in store.rows] == (
        ["rank00000-000001.safetensors"] * 6 + ["rank00000-000002.safetensors"] * 5
    )
    expected = [*originals().values(), big, *originals().values()]
    for x, (_, y) in zip(expected, store, strict=True):
        assert torch.equal(y, x)


def test_s3_a_failed_multipart_write_publishes_no_object(s3: tuple[dict, str]) -> None:
    options, bucket = s3
    url = f"s3://{bucket}/failed/captures"
    big = torch.arange(3 << 20, dtype=torch.float32)  # parts are uploaded before the failure
    bad = record(1, torch.zeros(2), "bad")._replace(data=Unreadable())
    with pytest.raises(RuntimeError, match="staging memory gone"):
        FsspecSink(url, storage_options=options).write([record(0, big, "big"), bad])
    fs = fsspec.filesystem("s3", **options)
    assert fs.find(bucket) == []
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
