import json

import pytest

from syncless.run import RankInfo, Run, StepRecord
from syncless.run import open as open_run


class ExplodingSink:
    def __init__(self):
        self.calls = 0

    def write(self, records):
        self.calls += 1
        raise OSError("disk on fire")

    def close(self):
        pass


class ListSink:
    def __init__(self):
        self.records: list[StepRecord] = []

    def write(self, records):
        self.records += records

    def close(self):
        pass


def test_run_json_and_records(tmp_path):
    with Run(name="t", config={"lr": 0.1}, run_dir=tmp_path / "r") as run:
        run.log(0, {"demo/step/loss": 2.0})
        run.log(1, {"demo/step/loss": 1.5})
    meta = json.loads((tmp_path / "r" / "run.json").read_text())
    assert meta["format"] == "syncless-run/1"
    assert meta["config"] == {"lr": 0.1}
    assert meta["world_size"] == 1
    assert {"python", "torch", "host", "git_commit"} <= set(meta["env"])
    with open_run(tmp_path / "r") as store:
        _, rows = store.query("SELECT step, rank, name, value, run FROM metrics ORDER BY step")
    assert rows == [(0, 0, "demo/step/loss", 2.0, "r"), (1, 0, "demo/step/loss", 1.5, "r")]


def test_failing_sink_is_counted_not_raised(tmp_path, capsys):
    bad, good = ExplodingSink(), ListSink()
    run = Run(run_dir=tmp_path / "r", sinks=[bad, good], max_sink_errors=3)
    for step in range(5):
        run.log(step, {"demo/step/loss": float(step)})
    run.close()
    assert bad.calls == 3  # dropped after max_sink_errors
    assert [r.step for r in good.records if r.name == "demo/step/loss"] == [0, 1, 2, 3, 4]
    counts = [r.value for r in good.records if r.name == "run/self/ExplodingSink_errors_count"]
    assert counts == [1, 2, 3, 3]  # reported from the batch after each failure
    assert "sink ExplodingSink failed" in capsys.readouterr().err


def test_strict_mode_raises(tmp_path):
    run = Run(run_dir=tmp_path / "r", sinks=[ExplodingSink()], strict=True)
    with pytest.raises(OSError, match="disk on fire"):
        run.log(0, {"demo/step/loss": 1.0})
    run.close()


@pytest.mark.parametrize("bad", ["loss", "demo//loss", "demo/step/loss ms", "/demo/x"])
def test_bad_metric_names_are_rejected(tmp_path, bad):
    with Run(run_dir=tmp_path / "r") as run, pytest.raises(ValueError, match="area/scope/name"):
        run.log(0, {bad: 1.0})


def test_only_rank_zero_writes_run_json(tmp_path):
    Run(run_dir=tmp_path / "r", ranks=RankInfo(rank=1, world_size=2, local_rank=1)).close()
    assert not (tmp_path / "r" / "run.json").exists()
    assert (tmp_path / "r" / "metrics").is_dir()


def test_each_rank_records_where_it_runs(tmp_path):
    import os
    import socket

    Run(run_dir=tmp_path / "r", ranks=RankInfo(rank=0, world_size=2, local_rank=0)).close()
    Run(run_dir=tmp_path / "r", ranks=RankInfo(rank=1, world_size=2, local_rank=1)).close()
    for rank in (0, 1):
        place = json.loads((tmp_path / "r" / "ranks" / f"rank{rank:05d}.json").read_text())
        expected = {
            "rank": rank,
            "host": socket.gethostname(),
            "local_rank": rank,
            "pid": os.getpid(),
            "gpu": "",
        }  # fmt: skip (no CUDA here)
        assert place == expected


def test_a_place_that_cannot_be_written_is_reported_not_raised(tmp_path, capsys, monkeypatch):
    import syncless.run.run as run_module

    def refuse(*args):
        raise OSError("read-only file system")

    monkeypatch.setattr(run_module, "write_placement", refuse)
    Run(run_dir=tmp_path / "r").close()
    assert "could not record this rank's host" in capsys.readouterr().err
    with pytest.raises(OSError, match="read-only"):
        Run(run_dir=tmp_path / "s", strict=True)
