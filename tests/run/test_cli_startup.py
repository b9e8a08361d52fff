"""``syncless --help``, ``query``, ``check`` and ``lint`` start without what they do not
need (issues #21, #48).

Importing torch was 1.5 s of a 1.9 s ``--help``; later the demo's arguments, pyarrow and
rich were 0.4 s of a 0.48 s ``--help`` and of every query. Each command runs in a fresh
interpreter, which then reports which heavy modules were imported; the time itself is a
bench (``bench/store/cli_startup.py``), not a timed test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from run_store_helpers import make_run, write_shards

PROBE = """
import contextlib, io, json, sys
import syncless.cli
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        rc = syncless.cli.main(sys.argv[1:])
    except SystemExit as e:  # --help exits from argparse
        rc = e.code
heavy = ("torch", "numpy", "pyarrow", "duckdb", "rich", "plotly", "pandas", "syncless.demo",
         "syncless.lint", "syncless.report")
loaded = sorted(m for m in heavy if m in sys.modules)
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules, "loaded": loaded,
                  "out": out.getvalue()}))
"""


def _probe(*argv: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = make_run(tmp_path_factory.mktemp("startup") / "run")
    write_shards(run, 0, [[0, 1, 2]])
    return run


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--help"], "demo"),
        (["demo", "--help"], "--preset"),
        (["query", "--help"], "--strict"),
        (["lint", "--help"], "hot-path"),
    ],
)
def test_help_imports_no_torch(argv, expected):
    result = _probe(*argv)
    assert result["rc"] == 0
    assert expected in result["out"]
    assert not result["torch"]


def test_query_check_and_captures_import_no_torch(run_dir):
    result = _probe("query", str(run_dir), "SELECT count(*) AS n FROM metrics", "--format", "csv")
    assert (result["rc"], result["out"].split()) == (0, ["n", "6"])  # 3 steps x 2 names
    assert not result["torch"]
    result = _probe("check", str(run_dir), "--format", "json")
    assert result["rc"] == 0
    assert not result["torch"]
    result = _probe("captures", str(run_dir))
    assert result["rc"] == 1  # no captures in this run
    assert not result["torch"]


def test_lint_imports_no_torch(tmp_path):
    source = tmp_path / "hook.py"
    source.write_text("import syncless\n\n@syncless.hot_path\ndef f(x):\n    return x.item()\n")
    result = _probe("lint", str(source))
    assert result["rc"] == 1  # the .item() is a finding
    assert not result["torch"]


def test_the_run_package_still_exports_its_names():
    import syncless.run

    assert sorted(syncless.run.__all__) == sorted(syncless.run._HOMES)
    assert set(syncless.run.__all__) <= set(dir(syncless.run))
    for name in syncless.run.__all__:
        assert getattr(syncless.run, name).__module__.startswith("syncless.run.")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        syncless.run.nope  # noqa: B018


# What a command may import: what it needs, and no more (issue #48).
NEEDS = {
    "--help": set(),
    "query": {"duckdb"},  # rows print as a text table of its own, not through rich
    # Its reader lives in syncless.report, without the page (plotly) or numpy.
    "stragglers": {"duckdb", "syncless.report"},
    "compare --help": set(),
    "report --help": set(),
    "demo --help": {"syncless.demo"},  # its arguments; torch only to train
}


@pytest.mark.parametrize("command", NEEDS)
def test_a_command_imports_only_what_it_needs(run_dir, command):
    argv = command.split()
    if argv[0] == "query":
        argv += [str(run_dir), "SELECT count(*) AS n FROM metrics", "--format", "csv"]
    elif argv[0] == "stragglers":
        argv += [str(run_dir)]
    result = _probe(*argv)
    assert result["rc"] == 0
    assert set(result["loaded"]) == NEEDS[command], result["loaded"]


def test_help_still_lists_every_command():
    out = _probe("--help")["out"]
    for command in ("demo", "query", "check", "compact", "captures", "lint", "report",
                    "summary", "compare", "trace"):  # fmt: skip
        assert f"\n    {command} " in out, command
