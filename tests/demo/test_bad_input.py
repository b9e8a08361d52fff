"""Bad input: a clear message and exit status 2, never a traceback."""

import subprocess
import sys

import pytest

from syncless.cli import main
from syncless.run import Run


def _fails(argv, capsys, *fragments):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("syncless: error: ")
    for fragment in fragments:
        assert fragment in err
    return err


def test_unknown_preset_lists_the_valid_ones(capsys):
    _fails(["demo", "--preset", "huge"], capsys, "'huge'", "tiny, small, large")


def test_experts_not_divisible_by_ranks(capsys):
    _fails(["demo", "--nproc", "3", "--expert-parallel"], capsys, "4 experts over 3 ranks")


def test_experts_not_divisible_inside_a_torchrun_rank(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    _fails(["demo", "--expert-parallel", "--n-experts", "8"], capsys, "8 is not divisible by 3")


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--d-model", "30", "--n-heads", "4"], "divisible by --n-heads"),
        (["--top-k", "5"], "--top-k (5)"),
        (["--steps", "0"], "--steps must be > 0"),
        (["--device", "tpu"], "--device must be"),
    ],
)
def test_bad_knobs(capsys, flags, fragment):
    _fails(["demo", *flags], capsys, fragment)


def test_query_of_a_directory_that_is_not_a_run(capsys, tmp_path):
    _fails(["query", str(tmp_path), "SELECT 1"], capsys, "is not a syncless run")
    _fails(["query", str(tmp_path / "nope"), "SELECT 1"], capsys, "does not exist")


def test_query_sql_error(capsys, tmp_path):
    Run(run_dir=tmp_path / "r").close()
    _fails(["query", str(tmp_path / "r"), "SELECT FROM WHERE"], capsys, "query failed")


def test_no_traceback_from_the_real_command():
    proc = subprocess.run(
        [sys.executable, "-m", "syncless.cli", "demo", "--preset", "huge"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "valid presets: tiny, small, large" in proc.stderr


def test_an_object_store_run_dir_is_refused_with_where_it_is_taken(capsys):
    _fails(
        ["demo", "--run-dir", "s3://bucket/runs/x", "--steps", "1"],
        capsys,
        "--run-dir s3://bucket/runs/x: the demo writes its run to a local directory",
        "Run(run_dir=URL)",
    )
