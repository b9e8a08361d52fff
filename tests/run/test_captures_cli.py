"""``syncless captures RUN_DIR`` lists a run's captures from their index (issue #23)."""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch
from run_store_helpers import make_run, truncate

from syncless.capture.sinks.shards import CapturedRecord, SafetensorsSink
from syncless.cli import main

# tag -> one tensor per (step, rank); dtypes and shapes differ between the tags
TENSORS = {
    (tag, step, rank): torch.arange(n, dtype=dtype).reshape(shape)
    for tag, dtype, shape, n in (
        ("layer_00/hidden", torch.bfloat16, (4, 8), 32),
        ("router/logits", torch.float32, (16, 3), 48),
    )
    for step in (2, 5, 9)
    for rank in (0, 1)
}


def _write(run_dir) -> None:
    for rank in (0, 1):
        sink = SafetensorsSink(run_dir, rank)
        for step in (2, 5, 9):  # one index shard per step
            records = []
            for seq, ((tag, s, r), t) in enumerate(TENSORS.items()):
                if (s, r) == (step, rank):
                    data = t.contiguous().view(torch.uint8).flatten()
                    records.append(
                        CapturedRecord(
                            seq, tag, s, r, tuple(t.shape), t.dtype, data.numel(), None, data
                        )
                    )
            sink.write(records)


@pytest.fixture
def run_dir(tmp_path):
    run = make_run(tmp_path / "run", world_size=2)
    _write(run)
    return run


def _csv(capsys, *argv) -> list[dict]:
    assert main(["captures", *argv, "--format", "csv"]) == 0
    return list(csv.DictReader(io.StringIO(capsys.readouterr().out)))


def test_per_tag_counts_steps_ranks_dtypes_shapes_and_bytes(run_dir, capsys):
    rows = {r["tag"]: r for r in _csv(capsys, str(run_dir))}
    assert sorted(rows) == ["layer_00/hidden", "router/logits"]
    for tag, row in rows.items():
        mine = [t for (g, _, _), t in TENSORS.items() if g == tag]
        assert int(row["tensors"]) == len(mine) == 6
        assert (row["first_step"], row["last_step"], row["steps"], row["ranks"]) == (
            "2", "9", "3", "2"
        )  # fmt: skip
        assert row["dtypes"] == str(mine[0].dtype).removeprefix("torch.")
        assert row["shapes"] == "x".join(map(str, mine[0].shape))
        assert int(row["bytes"]) == sum(t.numel() * t.element_size() for t in mine)


def test_all_lists_every_tensor_in_step_then_rank_order(run_dir, capsys):
    assert main(["captures", str(run_dir), "--all", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    expected = sorted(
        ((s, r, tag, t.numel() * t.element_size()) for (tag, s, r), t in TENSORS.items()),
    )
    got = sorted((row["step"], row["rank"], row["tag"], row["bytes"]) for row in rows)
    assert got == expected
    assert [(row["step"], row["rank"]) for row in rows] == sorted(
        (row["step"], row["rank"]) for row in rows
    )


def test_a_run_without_captures_exits_1_with_one_line(tmp_path, capsys):
    run = make_run(tmp_path / "plain")
    assert main(["captures", str(run)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no captures" in err and "--capture" in err


def test_an_unreadable_index_shard_is_skipped_with_a_warning(run_dir, capsys):
    cut = sorted((run_dir / "captures").glob("rank00001-*.parquet"))[0]
    truncate(cut)
    assert main(["captures", str(run_dir), "--format", "csv"]) == 0
    out, err = capsys.readouterr()
    rows = {r["tag"]: r for r in csv.DictReader(io.StringIO(out))}
    assert int(rows["router/logits"]["tensors"]) == 5  # rank 1's step-2 shard is gone
    assert err.startswith("syncless: warning: ") and cut.name in err
    assert main(["captures", str(run_dir), "--strict"]) == 1
    assert cut.name in capsys.readouterr().err
