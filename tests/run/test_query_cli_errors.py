"""``syncless query`` and ``syncless check`` fail in one line, never with a traceback, and
a closed pipe ends the output quietly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from run_store_helpers import make_run, write_shards

from syncless.cli import main


def bad_run_dirs(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """name -> (path, what the one-line error says)."""
    (tmp_path / "a_file").write_text("not a directory")
    latin = tmp_path / "latin1"
    latin.mkdir()
    (latin / "run.json").write_bytes(b'{"format": "caf\xe9"}')
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "run.json").write_text("{not json")
    return {
        "missing": (str(tmp_path / "missing"), "does not exist"),
        "a_file": (str(tmp_path / "a_file"), "is a file, not a run directory"),
        "proc_file": ("/proc/self/status", "is a file, not a run directory"),
        "proc_dir": ("/proc/self", "is not a syncless run: it has no run.json"),
        "proc_missing": ("/proc/self/no-such-entry", "does not exist"),
        "run_json_not_utf8": (str(latin), "cannot read run directory"),
        "run_json_not_json": (str(broken), "is not valid JSON"),
    }


CASES = ["missing", "a_file", "proc_file", "proc_dir", "proc_missing", "run_json_not_utf8"]
CASES += ["run_json_not_json"]
COMMANDS = {
    "query": lambda path: ["query", path, "SELECT count(*) FROM metrics"],
    "check": lambda path: ["check", path],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", CASES)
def test_a_bad_run_dir_is_a_one_line_usage_error(tmp_path, capsys, command, case):
    if case.startswith("proc") and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    cases = bad_run_dirs(tmp_path)
    assert sorted(cases) == sorted(CASES)
    path, says = cases[case]
    assert main(COMMANDS[command](path)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("syncless: error: ") and says in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_bad_run_dir_fails_a_real_process_in_one_line(tmp_path):
    for args in (["query", str(tmp_path / "missing"), "SELECT 1"], ["check", "/proc/self/status"]):
        done = subprocess.run(
            [sys.executable, "-m", "syncless.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2
        assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith("syncless: error: ")


@pytest.mark.parametrize("sql", ["", "   ", "-- only a comment\n", ";"])
def test_empty_sql_is_a_usage_error(tmp_path, capsys, sql):
    run = make_run(tmp_path / "run")
    assert main(["query", str(run), sql]) == 2
    _, err = capsys.readouterr()
    assert err.startswith("syncless: error: empty query") and err.count("\n") == 1


def test_invalid_sql_is_a_usage_error(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    assert main(["query", str(run), "SELEC nonsense"]) == 2
    assert capsys.readouterr().err.startswith("syncless: error: query failed: Parser Error")


@pytest.mark.parametrize(("fmt", "rows"), [("csv", 100_000), ("json", 100_000), ("table", 5_000)])
def test_a_closed_pipe_ends_the_output_quietly_with_status_0(tmp_path, fmt, rows):
    run = make_run(tmp_path / "run")
    write_shards(run, rank=0, shards=[[0]])
    # Far more output than a pipe buffers, so the writer is still writing when the
    # reader goes: it blocks on the full pipe until the read end closes.
    sql = f"SELECT range AS i, 'padding padding padding' AS p FROM range({rows})"
    with subprocess.Popen(
        [sys.executable, "-m", "syncless.cli", "query", str(run), sql, "--format", fmt],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdout.readline()  # `| head -1`
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 0
    assert err == b""


def test_check_keeps_its_status_when_the_pipe_closes(tmp_path):
    run = make_run(tmp_path / "run")
    # Steps 0, 1, 3, 4, 6, 7, ...: 2,000 one-step gaps, well over a pipe's buffer of JSON.
    write_shards(run, rank=0, shards=[[s for s in range(6000) if s % 3 != 2]], names=1)
    with subprocess.Popen(
        [sys.executable, "-m", "syncless.cli", "check", str(run), "--format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 1
    assert err == b""
