"""The safetensors sink, its index, reading back, and sink failures."""

from __future__ import annotations

import errno
import json
import re
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from syncless.capture import CapturedRecord, CaptureEngine, EngineConfig, SafetensorsSink
from syncless.capture import open as open_captures
from syncless.errors import UsageError
from syncless.guard import no_sync

MiB = 1 << 20


def record(seq: int, tensor: torch.Tensor, tag: str = "x", step: int | None = 0) -> CapturedRecord:
    t = tensor.contiguous()
    data = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return CapturedRecord(seq, tag, step, 0, tuple(t.shape), t.dtype, data.numel(), None, data)


def read_header(path: Path) -> tuple[dict, int]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), 8 + n


def test_shards_are_valid_safetensors_with_an_index_that_points_into_them(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    xs = {
        "a": torch.randn(3, 4),
        "b": torch.arange(5, dtype=torch.int64),
        "c": torch.tensor(True),
        "d": torch.randn(2, 2, dtype=torch.complex64),
        "e": torch.empty(0, 3, dtype=torch.bfloat16),
        "f": torch.randn(3, dtype=torch.complex128),  # no safetensors code: raw bytes
    }
    sink = SafetensorsSink(tmp_path, rank=0)
    sink.write([record(i, x, tag) for i, (tag, x) in enumerate(xs.items())])

    (shard,) = (tmp_path / "captures").glob("*.safetensors")
    assert shard.name == "rank00000-000001.safetensors"
    header, data_start = read_header(shard)
    assert data_start % 8 == 0  # the header is space-padded, as the format allows
    assert header["__metadata__"]["format"] == "syncless-capture/1"
    loaded = safetensors.load_file(shard)
    index = pq.read_table(tmp_path / "captures" / "rank00000-000001.parquet").to_pylist()
    blob = shard.read_bytes()
    for row, (tag, x) in zip(index, xs.items(), strict=True):
        assert row["tag"] == tag and row["file"] == shard.name
        on_disk = blob[row["offset"] : row["offset"] + row["nbytes"]]
        assert on_disk == x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        if tag == "f":
            assert loaded[row["key"]].dtype == torch.uint8  # typed by the index instead
            assert header[row["key"]]["shape"] == [x.numel() * 16]
        else:
            assert torch.equal(loaded[row["key"]], x)
    assert not list((tmp_path / "captures").glob(".*"))  # no temporary files left


def test_reader_selects_by_tag_step_and_rank_across_ranks_and_shards(tmp_path: Path) -> None:
    for rank in (1, 0):
        for shard in range(2):
            sink = SafetensorsSink(tmp_path, rank=rank)  # reopening continues the numbering
            sink.write(
                [
                    record(2 * shard + i, torch.full((2,), 100.0 * rank + 10 * shard + i), f"t{i}", shard)
                    ._replace(rank=rank, meta=json.dumps({"r": rank}))
                    for i in range(2)
                ]
            )  # fmt: skip
    names = sorted(p.name for p in (tmp_path / "captures").glob("*.safetensors"))
    assert names == [f"rank0000{r}-00000{s}.safetensors" for r in (0, 1) for s in (1, 2)]

    store = open_captures(tmp_path)
    assert len(store) == 8
    assert [(r["rank"], r["seq"]) for r in store.rows] == [(r, s) for r in (0, 1) for s in range(4)]
    assert store.tags() == ["t0", "t1"]
    hits = store.select(tag="t1", step=1, rank=1)
    assert len(hits) == 1 and store.tensor(hits[0]).tolist() == [111.0, 111.0]
    assert store.meta(hits[0]) == {"r": 1}
    assert len(store.select(step=0)) == 4
    assert [t.tolist() for t in store.tensors(tag="t0", rank=0)] == [[0.0, 0.0], [10.0, 10.0]]
    assert sum(1 for _ in store) == 8
    assert len(open_captures(tmp_path / "captures")) == 8  # the folder itself works too


def test_reader_errors_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        open_captures(tmp_path / "nope")
    with pytest.raises(UsageError, match="has no captures"):
        open_captures(tmp_path)
    sink = SafetensorsSink(tmp_path)
    sink.write([record(0, torch.randn(100))])
    assert len(open_captures(tmp_path)) == 1
    shard = tmp_path / "captures" / "rank00000-000001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(UsageError, match="truncated"):
        open_captures(tmp_path).tensor(0)


def test_an_empty_captures_folder_reads_as_no_captures(tmp_path: Path) -> None:
    (tmp_path / "captures").mkdir()
    store = open_captures(tmp_path)
    assert len(store) == 0 and store.select(tag="x") == []


class FailingSink:
    """Fails every ``fail_every``-th write (1: always)."""

    def __init__(self, fail_every: int = 1) -> None:
        self.fail_every = fail_every
        self.calls = 0
        self.written: list[int] = []

    def write(self, records: Sequence[CapturedRecord]) -> None:
        self.calls += 1
        if self.calls % self.fail_every == 0:
            raise OSError("disk full")
        self.written += [r.seq for r in records]

    def close(self) -> None:
        pass


def test_sink_failures_are_counted_as_dropped_records_and_training_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sink = FailingSink(fail_every=2)
    # shard_bytes = one record: every record is its own shard, every other one fails.
    config = EngineConfig(shard_bytes=64)
    engine = CaptureEngine(1 << 12, 1 << 10, sink, device="cpu", background=False, config=config)
    with no_sync():
        for i in range(10):
            assert engine.capture("x", torch.full((16,), float(i)))
            engine.poll()
    engine.close()
    assert sink.written == [0, 2, 4, 6, 8]
    c = engine.counters()
    assert engine.dropped()["sink_error"] == 5 and c["dropped_sink_error_bytes"] == 5 * 64
    assert c["sink_errors_count"] == 5 and c["stored_count"] == 5
    assert c["offered_count"] == c["stored_count"] + sum(engine.dropped().values())
    err = capsys.readouterr().err
    assert err.count("disk full") == 1  # reported once
    assert "volume is full" not in err  # an OSError without ENOSPC gets no disk hint


class FullVolumeSink(SafetensorsSink):
    """Writes its first shard, then fails as a full volume does."""

    def write(self, records: Sequence[CapturedRecord]) -> None:
        if any(self.dir.glob("*.safetensors")):
            raise OSError(errno.ENOSPC, "No space left on device")
        super().write(records)


def test_a_full_volume_is_reported_with_its_free_space_and_what_was_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = torch.zeros(4 * MiB)  # 16 MiB: one shard each, 0.02 GB once stored
    sink = FullVolumeSink(tmp_path)
    # One writer: the shards are written in order, so the first is the one stored.
    config = EngineConfig(shard_bytes=record.nbytes, writers=1)
    engine = CaptureEngine(64 * MiB, 32 * MiB, sink, device="cpu", config=config)
    with no_sync():
        for i in range(3):
            assert engine.capture("x", record, step=i)
    engine.close()
    err = capsys.readouterr().err
    assert engine.dropped()["sink_error"] == 2
    found = re.search(r"volume is full: ([0-9.]+) GB free under (\S+), ([0-9.]+) GB stored", err)
    assert found, err
    free_gb = shutil.disk_usage(tmp_path).free / 1e9
    assert abs(float(found[1]) - free_gb) < 1.0 and found[2] == str(sink.dir)
    assert len(list(sink.dir.glob("*.safetensors"))) == 1
    assert float(found[3]) == round(record.nbytes / 1e9, 2)  # the one stored shard's tensor


def test_strict_mode_raises_sink_errors_on_the_training_thread() -> None:
    config = EngineConfig(shard_bytes=16)  # every record is due at once
    engine = CaptureEngine(
        1 << 12, 1 << 10, FailingSink(), device="cpu", background=False, strict=True, config=config
    )
    engine.capture("x", torch.zeros(4))
    engine.poll()  # drained and written: the sink fails on the writer's side
    with pytest.raises(RuntimeError, match="disk full"):
        engine.capture("y", torch.zeros(4))  # ... and the next capture raises it
    engine.capture("z", torch.zeros(4))  # raised once; "z" fails in the sink again
    with pytest.raises(RuntimeError, match="disk full"):
        engine.flush()
    engine.close()
    assert engine.dropped()["sink_error"] == 2


@pytest.mark.parametrize("failing", ["tensors", "index"])
def test_a_write_that_fails_on_a_full_disk_leaves_no_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    # A failed shard's records are counted as dropped; a partial file, or a shard with
    # no index, would also hold the disk space the next write needs.
    import syncless.capture.sinks.shards as sink_module

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    sink = SafetensorsSink(tmp_path, rank=0)
    x = torch.arange(1000, dtype=torch.float32)
    with monkeypatch.context() as patch:
        if failing == "tensors":
            patch.setattr(sink_module.struct, "pack", full_disk)
        else:
            patch.setattr(sink_module.pq, "write_table", full_disk)
        with pytest.raises(OSError, match="No space left"):
            sink.write([record(0, x)])
    folder = tmp_path / "captures"
    assert [p.name for p in folder.iterdir()] == []  # hidden temporaries included
    sink.write([record(1, x)])  # the disk has room again; the number is free again too
    assert sorted(p.name for p in folder.iterdir()) == [
        "rank00000-000001.parquet",
        "rank00000-000001.safetensors",
    ]
    (row,) = pq.read_table(folder / "rank00000-000001.parquet").to_pylist()
    blob = (folder / "rank00000-000001.safetensors").read_bytes()
    assert blob[row["offset"] : row["offset"] + row["nbytes"]] == x.numpy().tobytes()
