"""`syncless demo` with a run directory the OS refuses: one line, exit 2, no traceback."""

import subprocess
import sys

import pytest

from syncless.cli import main

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="needs /proc")


def _demo(*argv):
    cmd = [sys.executable, "-m", "syncless.cli", "demo", "--steps", "2", "--quiet", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def _one_line(err, *fragments):
    assert "Traceback" not in err
    assert err.count("\n") == 1, err
    assert err.startswith("syncless: error: cannot create the run directory ")
    for fragment in fragments:
        assert fragment in err


@linux_only
def test_a_run_dir_under_proc_is_one_line_and_exit_2():
    proc = _demo("--no-report", "--run-dir", "/proc/xx-syncless")
    assert proc.returncode == 2, proc.stderr
    _one_line(proc.stderr, "'/proc/xx-syncless'", "No such file or directory", "--run-dir")


def test_a_run_dir_whose_parent_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    run_dir = tmp_path / "file" / "run"
    assert main(["demo", "--steps", "2", "--quiet", "--run-dir", str(run_dir)]) == 2
    _one_line(capsys.readouterr().err, f"'{run_dir}'", "Not a directory")


@linux_only
@pytest.mark.dist
def test_nproc_refuses_a_run_dir_it_cannot_create_before_starting_any_rank():
    proc = _demo("--nproc", "2", "--run-dir", "/proc/xx-syncless")
    assert proc.returncode == 2, proc.stderr
    _one_line(proc.stderr, "'/proc/xx-syncless'", "No such file or directory")
    assert "torch.distributed" not in proc.stderr  # torchrun never started


@linux_only
@pytest.mark.dist
def test_nproc_refuses_a_generated_run_dir_it_cannot_create(tmp_path):
    (tmp_path / "runs").write_text("")  # where generated directories would go
    cmd = [sys.executable, "-m", "syncless.cli", "demo", "--nproc", "2", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert "'runs'" in proc.stderr and "Not a directory" in proc.stderr
