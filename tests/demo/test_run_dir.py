"""`syncless demo` and its run directory: refused when taken, resumed when asked."""

import json
import subprocess
import sys

import pytest

from syncless.cli import main
from syncless.run import open as open_run


def _demo(*argv):
    return main(["demo", "--steps", "3", "--quiet", *argv])


def test_a_second_demo_into_the_same_directory_is_refused(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    assert _demo("--run-dir", run_dir) == 0
    before = (tmp_path / "run" / "run.json").read_text()
    capsys.readouterr()
    assert _demo("--run-dir", run_dir, "--seed", "7") == 2
    err = capsys.readouterr().err
    assert err.startswith("syncless: error: run directory ")
    assert "already holds a run" in err and "--resume" in err
    assert err.count("\n") == 1  # one line
    assert (tmp_path / "run" / "run.json").read_text() == before
    with open_run(run_dir) as store:
        _, rows = store.query("SELECT step, count(*) FROM metrics WHERE name = 'demo/step/loss' "
                              "GROUP BY step ORDER BY step")  # fmt: skip
    assert rows == [(0, 1), (1, 1), (2, 1)]  # no step stored twice


def test_resume_goes_on_from_the_last_step_in_a_new_segment(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    assert _demo("--run-dir", run_dir, "--seed", "1") == 0
    assert _demo("--run-dir", run_dir, "--seed", "2", "--resume") == 0
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    segments = [(s["seed"], s["first_step"], s["world_size"]) for s in meta["segments"]]
    assert segments == [(1, 0, 1), (2, 3, 1)]
    with open_run(run_dir) as store:
        _, rows = store.query("SELECT step, count(*) FROM metrics WHERE name = 'demo/step/loss' "
                              "GROUP BY step ORDER BY step")  # fmt: skip
    assert rows == [(s, 1) for s in range(6)]


def test_resume_needs_a_run_dir(capsys):
    assert _demo("--resume") == 2
    assert "--resume needs --run-dir" in capsys.readouterr().err


@pytest.mark.dist
def test_nproc_refuses_a_taken_directory_before_starting_any_rank(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    proc = subprocess.run(
        [sys.executable, "-m", "syncless.cli", "demo", "--nproc", "2",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("syncless: error: run directory ")
    assert "torch.distributed" not in proc.stderr  # torchrun never started


@pytest.mark.dist
def test_nproc_ranks_share_one_generated_directory(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "syncless.cli", "demo", "--nproc", "2", "--steps", "3", "--quiet"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and runs[0].name.endswith("-demo-tiny")
    assert proc.stdout.strip() == str(runs[0].relative_to(tmp_path))
    with open_run(runs[0]) as store:
        _, rows = store.query("SELECT DISTINCT rank FROM metrics ORDER BY rank")
        assert rows == [(0,), (1,)]
        assert store.info["segments"][0]["world_size"] == 2
