"""``syncless stragglers RUN`` and the report's straggler section read back the verdicts a
run stored (ground truth: the ranks, sections and steps made slow in the records)."""

import contextlib
import io
import json

import pytest
from test_stragglers import BASE_MS, STEPS, _report

from syncless.cli import main
from syncless.profile.report import straggler_values
from syncless.profile.stragglers import StragglerDetector, fleet
from syncless.run import ParquetSink
from syncless.run.records import StepRecord
from syncless.run.rundir import METRICS_DIR, write_run_json

WORLD = 8
REPORTS = 10
CLOCK = {"sm_clock_mhz": 1980.0, "sm_clock_min_mhz": 1980.0}


def _slow_at(i):
    """Report ``i``: rank 3's backward 4x as slow in reports 4..7, rank 5's data 10x
    from report 6 on."""
    slow = {}
    if 4 <= i <= 7:
        slow[3] = {"backward": 3 * BASE_MS["backward"]}
    if i >= 6:
        slow[5] = {"data": 9 * BASE_MS["data"]}
    return slow


def _sensors_at(i):
    """Rank 1's SM clock fell to 1,300 MHz in report 2 alone."""
    out = [dict(CLOCK) for _ in range(WORLD)]
    if i == 2:
        out[1] = {"sm_clock_mhz": 1500.0, "sm_clock_min_mhz": 1300.0}
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run whose ranks stored what the profiler stores for straggler verdicts."""
    path = tmp_path_factory.mktemp("stragglers") / "run"
    path.mkdir()
    write_run_json(path, {"name": "stragglers", "world_size": WORLD})
    detector = StragglerDetector()
    records = {r: [] for r in range(WORLD)}
    for i in range(REPORTS):
        first, last = i * STEPS, i * STEPS + STEPS - 1
        verdicts = detector.update(fleet(_report(WORLD, _slow_at(i), sensors=_sensors_at(i))),
                                   first, last)  # fmt: skip
        for rank in range(WORLD):
            values = straggler_values(detector, verdicts, rank, lead=rank == 0)
            values["profile/gpu_sensors/sm_clock_min_mhz"] = _sensors_at(i)[rank][
                "sm_clock_min_mhz"
            ]
            records[rank] += [StepRecord("run", last, rank, k, v, 0.0) for k, v in values.items()]
    for rank, recs in records.items():
        sink = ParquetSink(path / METRICS_DIR, rank, flush_interval_s=3600)
        sink.write(recs)
        sink.close()
    (path / "ranks").mkdir()
    for rank in range(WORLD):  # each rank's Run writes one; rank 1's is missing here
        if rank != 1:
            (path / "ranks" / f"rank{rank:05d}.json").write_text(json.dumps(_place(rank)))
    return path


def _place(rank):
    """Two ranks a node, as a Run records where it runs (docs/stragglers.md)."""
    return {"rank": rank, "host": f"node-{rank // 2}", "local_rank": rank % 2, "pid": 100 + rank,
            "gpu": f"cuda:{rank % 2} 0000:{rank:02x}:00.0"}  # fmt: skip


def _cli(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv)) == 0
    return out.getvalue()


def test_json_names_each_episode_with_its_steps(run_dir):
    got = json.loads(_cli("stragglers", str(run_dir), "--format", "json"))
    by_key = {(v["rank"], v["section"]): v for v in got}
    assert set(by_key) == {(3, "backward"), (5, "data"), (1, "gpu_clock")}
    backward = by_key[3, "backward"]
    assert (backward["first_step"], backward["last_step"]) == (4 * STEPS, 8 * STEPS - 1)
    data = by_key[5, "data"]
    assert (data["first_step"], data["last_step"]) == (6 * STEPS, REPORTS * STEPS - 1)
    # At the last report the window holds 4 reports of rank 5's data at 10x and one at
    # 1x: own = 2 * (4 * 10 + 1) / 5 = 16.4 ms against the fleet's 2 ms.
    assert data["score"] == pytest.approx(2.0 / 16.4)
    clock = by_key[1, "gpu_clock"]
    assert (clock["first_step"], clock["last_step"]) == (2 * STEPS, 3 * STEPS - 1)
    assert clock["score"] == pytest.approx(1300.0 / 1980.0)
    assert clock["clock_mhz"] == 1300.0
    assert [v["score"] for v in got] == sorted(v["score"] for v in got)
    assert all(set(v) >= {"rank", "section", "score", "first_step", "last_step"} for v in got)
    for rank in (3, 5):  # where the named ranks ran, as their runs recorded it
        place = {k: v for k, v in by_key[rank, "data" if rank == 5 else "backward"].items()
                 if k in ("host", "local_rank", "gpu")}  # fmt: skip
        assert place == {k: _place(rank)[k] for k in ("host", "local_rank", "gpu")}
    assert "host" not in clock  # rank 1 recorded no place


def test_text_has_a_line_per_verdict(run_dir):
    text = _cli("stragglers", str(run_dir))
    assert "3 straggler verdict(s)" in text
    lines = [line.split() for line in text.splitlines()[2:]]
    assert [line[:2] for line in lines] == [["5", "data"], ["3", "backward"], ["1", "gpu_clock"]]
    assert "SM clock 1300 MHz" in text
    assert "node-2 local rank 1 cuda:1 0000:05:00.0" in text  # rank 5


def test_a_run_without_verdicts_says_so(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    write_run_json(path, {"name": "healthy", "world_size": 1})
    sink = ParquetSink(path / METRICS_DIR, 0, flush_interval_s=3600)
    sink.write([StepRecord("run", 9, 0, "profile/backward/straggler_score", 0.5, 0.0)])
    sink.close()
    assert "no stragglers" in _cli("stragglers", str(path))
    assert json.loads(_cli("stragglers", str(path), "--format", "json")) == []


def test_the_report_has_a_heat_map_and_the_verdicts(run_dir):
    pytest.importorskip("plotly")
    from syncless.report import html

    page = html.build(run_dir)
    assert 'id="stragglers"' in page and "fig-stragglers" in page
    assert "slowest: rank 5 in data" in page
    assert "node-1 local rank 1 cuda:1 0000:03:00.0" in page  # where rank 3 ran
    for section in ("backward", "data", "gpu_clock"):
        assert f"<td>{section}</td>" in page
