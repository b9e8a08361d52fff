"""``syncless check``: shard health, records, step ranges and gaps per rank, checked
against a recount of the records the test itself wrote."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from run_store_helpers import make_run, truncate, write_shards

from syncless.capture import CapturedRecord, SafetensorsSink
from syncless.cli import main
from syncless.run.check import Gap, check

NAMES = 2  # records per step (write_shards' default)


def expected_gaps(steps: set[int], stride: int) -> list[Gap]:
    """Missing steps by brute force: every stride step from the first to the last."""
    grid = range(min(steps), max(steps) + 1, stride)
    missing = [s for s in grid if s not in steps]
    gaps: list[Gap] = []
    for s in missing:
        if gaps and gaps[-1].last + stride == s:
            gaps[-1] = Gap(gaps[-1].first, s, gaps[-1].count + 1)
        else:
            gaps.append(Gap(s, s, 1))
    return gaps


def build_run(tmp_path: Path) -> tuple[Path, dict[int, list[list[int]]], Path]:
    """World size 4. Rank 0: every step 0-29, its shard of 10-14 truncated. Rank 1:
    steps 0-29 without 5, 6, 7 and 21. Rank 2: every 10th step 0-90 without 50.
    Rank 3: nothing."""
    run = make_run(tmp_path / "run", world_size=4)
    shards = {
        0: [list(range(0, 10)), list(range(10, 15)), list(range(15, 30))],
        1: [[s for s in range(0, 15) if s not in (5, 6, 7)], [s for s in range(15, 30) if s != 21]],
        2: [[0, 10, 20, 30], [40, 60, 70], [80, 90]],
    }
    written = {rank: write_shards(run, rank, steps) for rank, steps in shards.items()}
    bad = written[0][1]
    truncate(bad)
    shards[0][1] = []  # unreadable: none of its records count
    return run, shards, bad


def test_check_matches_a_recount_of_what_was_written(tmp_path):
    run, shards, bad = build_run(tmp_path)
    health = check(run)
    assert [s.path for s in health.unreadable] == [bad]
    assert len(health.shards) == 8
    assert [s.rows for s in health.shards if s.error is None] == [
        NAMES * len(steps) for rank in (0, 1, 2) for steps in shards[rank] if steps
    ]
    assert [r.rank for r in health.ranks] == [0, 1, 2]
    for r in health.ranks:
        steps = {s for shard in shards[r.rank] for s in shard}
        stride = 10 if r.rank == 2 else 1
        assert r.records == NAMES * len(steps)
        assert (r.first_step, r.last_step, r.steps, r.stride) == (
            min(steps),
            max(steps),
            len(steps),
            stride,
        )
        assert r.gaps == expected_gaps(steps, stride)
    assert [r.gaps for r in health.ranks] == [
        [Gap(10, 14, 5)],
        [Gap(5, 7, 3), Gap(21, 21, 1)],
        [Gap(50, 50, 1)],
    ]
    assert health.missing_ranks == [3]
    assert not health.healthy
    assert len(health.problems) == 1 + 1 + 3  # the shard, rank 3, a line per rank with gaps


def test_the_cli_reports_problems_plainly_and_exits_1(tmp_path, capsys):
    run, _, bad = build_run(tmp_path)
    assert main(["check", str(run)]) == 1
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # plain text when not a terminal
    lines = out.splitlines()
    assert (
        f"problem: unreadable shard {bad}: Parquet magic bytes not found in footer. Either the file is corrupted or this is not a parquet file."
        in lines
    )
    assert "problem: rank 3 of 4 has no records" in lines
    assert "problem: rank 1 is missing 4 step(s): 5-7, 21" in lines
    assert "problem: rank 2 is missing 1 step(s): 50" in lines
    assert lines[-1] == f"{run}: unhealthy: 5 problem(s)"
    row = next(line.split() for line in lines if line.split()[:1] == ["2"])
    assert row == ["2", "18", "0", "90", "9", "10", "1", "50"]


def test_json_output_carries_the_same_numbers(tmp_path, capsys):
    run, _, bad = build_run(tmp_path)
    assert main(["check", str(run), "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["healthy"] is False
    assert [s["path"] for s in doc["shards"] if s["error"]] == [str(bad)]
    assert [(r["rank"], r["records"], r["missing_steps"]) for r in doc["ranks"]] == [
        (0, 50, 5),
        (1, 52, 4),
        (2, 18, 1),
    ]
    assert doc["ranks"][1]["gaps"] == [
        {"first": 5, "last": 7, "count": 3},
        {"first": 21, "last": 21, "count": 1},
    ]


def test_a_whole_run_is_healthy(tmp_path, capsys):
    run = make_run(tmp_path / "run", world_size=2)
    for rank in (0, 1):
        write_shards(run, rank, [list(range(0, 5)), list(range(5, 8))])
    (run / "metrics" / ".rank00000-000003.parquet.tmp").write_bytes(b"half a shard")
    health = check(run)
    assert health.healthy and health.problems == []
    assert [(r.records, r.first_step, r.last_step, r.steps) for r in health.ranks] == [
        (16, 0, 7, 8)
    ] * 2
    assert health.temp_files == [str(run / "metrics" / ".rank00000-000003.parquet.tmp")]
    assert main(["check", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"{run}: healthy"
    assert "note: 1 temp file(s) of an interrupted write, ignored" in lines


def test_a_run_without_records_yet_is_healthy(tmp_path, capsys):
    run = make_run(tmp_path / "run", world_size=8)
    health = check(run)
    assert health.healthy and health.ranks == [] and health.shards == []
    assert main(["check", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "no shards yet"


def test_a_truncated_capture_file_is_a_problem(tmp_path):
    run = make_run(tmp_path / "run")
    write_shards(run, 0, [[0, 1]])
    sink = SafetensorsSink(run, rank=0)
    t = torch.arange(64, dtype=torch.float32)
    for seq in range(2):  # two capture shards of one 256-byte tensor each
        sink.write(
            [CapturedRecord(seq, "x", seq, 0, (64,), t.dtype, 256, None, t.view(torch.uint8))]
        )
    assert check(run).healthy
    data = sorted((run / "captures").glob("*.safetensors"))
    truncate(data[1])
    health = check(run)
    (problem,) = health.problems
    size = data[1].stat().st_size
    assert problem.startswith(
        f"capture file {data[1]} is truncated: {size} bytes, its index needs "
    )
    assert [s.rows for s in health.shards if s.table == "captures"] == [1, 1]


def test_a_resumed_run_expects_the_most_ranks_any_start_had(tmp_path):
    run = make_run(tmp_path / "run", world_size=1)
    meta = json.loads((run / "run.json").read_text())
    meta["segments"] = [{"world_size": 1}, {"world_size": 3}]
    (run / "run.json").write_text(json.dumps(meta))
    write_shards(run, 0, [[0, 1, 2]])
    write_shards(run, 2, [[3, 4]])
    health = check(run)
    assert health.world_size == 3 and health.missing_ranks == [1]
    assert health.problems == ["rank 1 of 3 has no records"]
