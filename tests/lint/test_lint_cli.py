"""`syncless lint` on the command line: output formats, exit codes, config, errors."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from syncless.lint.cli import add_arguments, main, run

HOOK = textwrap.dedent(
    """\
    def grad_hook(grad):
        return grad.item()
    """
)
CLEAN = textwrap.dedent(
    """\
    def grad_hook(grad):
        return grad * 2
    """
)
STEP = textwrap.dedent(
    """\
    def on_step_end(loss):
        return loss.item()
    """
)
LINE = re.compile(
    r"^(?P<path>[^:]+):(?P<line>\d+):(?P<col>\d+): (?P<rule>SL\d{3}) (?P<rest>.+) \((?P<hint>[^()]*(\([^()]*\)[^()]*)*)\)$"
)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty project directory with its own (empty) pyproject.toml, as cwd."""
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_clean_exits_0(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(project, "ok.py", CLEAN)
    assert main(["ok.py"]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == "syncless lint: no findings (1 file checked)"


def test_findings_exit_1_text_format(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(project, "hooks.py", HOOK)
    assert main(["hooks.py"]) == 1
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 1
    match = LINE.match(lines[0])
    assert match, lines[0]
    assert (match["path"], match["line"], match["col"], match["rule"]) == (
        "hooks.py",
        "2",
        "17",
        "SL001",
    )
    assert "grad_hook" in match["rest"]
    assert "1 finding in 1 file (1 file checked)" in err


def test_json_format(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(project, "hooks.py", HOOK)
    assert main(["--format", "json", "hooks.py"]) == 1
    out, _ = capsys.readouterr()
    findings = json.loads(out)
    assert len(findings) == 1
    finding = findings[0]
    assert set(finding) == {"path", "line", "col", "rule", "message", "function", "hint"}
    assert finding["path"] == "hooks.py"
    assert (finding["line"], finding["col"], finding["rule"]) == (2, 17, "SL001")
    assert finding["function"] == "grad_hook"
    assert isinstance(finding["message"], str) and finding["hint"]


def test_json_clean_is_empty_list(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(project, "ok.py", CLEAN)
    assert main(["--format", "json", "ok.py"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_missing_path_exits_2_and_keeps_going(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(project, "hooks.py", HOOK)
    assert main(["missing.py", "hooks.py"]) == 2
    out, err = capsys.readouterr()
    assert "hooks.py:2:17: SL001" in out
    assert "missing.py: error: no such file or directory" in err
    assert "1 error" in err


def test_unparsable_file_exits_2_and_keeps_going(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(project, "pkg/broken.py", "def f(:\n")
    write(project, "pkg/hooks.py", HOOK)
    assert main(["pkg"]) == 2
    out, err = capsys.readouterr()
    assert "hooks.py:2:17: SL001" in out
    assert re.search(r"broken\.py: error: cannot parse:1:\d+: ", err)
    assert "(1 file checked), 1 error" in err


def test_undecodable_file_exits_2(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (project / "latin.py").write_bytes(b"x = '\xff\xfe'\n")
    assert main(["latin.py"]) == 2
    assert "latin.py: error: cannot" in capsys.readouterr().err


def test_directory_walk(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(project, "src/a.py", HOOK)
    write(project, "src/sub/b.py", HOOK)
    write(project, "src/notes.txt", HOOK)
    write(project, "src/.hidden/c.py", HOOK)
    write(project, "src/__pycache__/d.py", HOOK)
    write(project, "src/venv/e.py", HOOK)
    assert main(["--format", "json", "src"]) == 1
    paths = sorted(Path(f["path"]).as_posix() for f in json.loads(capsys.readouterr().out))
    assert paths == ["src/a.py", "src/sub/b.py"]


def test_config_hot_path_patterns(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(project, "train.py", STEP)
    assert main(["train.py"]) == 0
    (project / "pyproject.toml").write_text(
        '[tool.syncless.lint]\nhot-path-patterns = ["on_step_*"]\n'
    )
    assert main(["train.py"]) == 1
    assert "train.py:2:17: SL001" in capsys.readouterr().out


def test_cli_hot_path_pattern(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(project, "train.py", STEP)
    assert main(["--hot-path-pattern", "x_*,on_step_*", "train.py"]) == 1


def test_config_exclude(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(project, "src/hooks.py", HOOK)
    write(project, "tests/cases/bad.py", HOOK)
    write(project, "gen/deep/generated/x.py", HOOK)
    (project / "pyproject.toml").write_text(
        '[tool.syncless.lint]\nexclude = ["tests/cases", "**/generated"]\n'
    )
    assert main(["--format", "json", "."]) == 1
    paths = {Path(f["path"]).as_posix() for f in json.loads(capsys.readouterr().out)}
    assert paths == {"src/hooks.py"}
    # Excludes hold for files named explicitly too (pre-commit passes file names).
    assert main(["tests/cases/bad.py", "gen/deep/generated/x.py"]) == 0
    assert "0 files checked" in capsys.readouterr().err


def test_cli_exclude_and_ignore(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(project, "a.py", HOOK)
    write(project, "b.py", HOOK)
    assert main(["--exclude", "a.py", "."]) == 1
    assert "a.py" not in capsys.readouterr().out
    assert main(["--ignore", "SL00", "."]) == 0


def test_config_found_by_walking_up(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (project / "pyproject.toml").write_text('[tool.syncless.lint]\nhot-path-patterns = ["on_*"]\n')
    write(project, "deep/er/train.py", STEP)
    monkeypatch.chdir(project / "deep" / "er")
    assert main(["train.py"]) == 1


def test_explicit_config(project: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    write(project, "train.py", STEP)
    other = tmp_path_factory.mktemp("cfg") / "lint.toml"
    other.write_text('[tool.syncless.lint]\nhot-path-patterns = ["on_step_end"]\n')
    assert main(["--config", str(other), "train.py"]) == 1


def test_bad_config_exits_2(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(project, "train.py", STEP)
    assert main(["--config", "nope.toml", "train.py"]) == 2
    assert "config file not found: nope.toml" in capsys.readouterr().err
    (project / "pyproject.toml").write_text('[tool.syncless.lint]\nhot-path-pattern = ["x"]\n')
    assert main(["train.py"]) == 2
    assert "unknown key 'hot-path-pattern'" in capsys.readouterr().err


def test_usage_error_exits_2() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2


def test_subcommand_wiring(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # How syncless/cli.py plugs it in: add_arguments on a subparser, run on the result.
    write(project, "hooks.py", HOOK)
    parser = argparse.ArgumentParser(prog="syncless")
    commands = parser.add_subparsers(dest="command", required=True)
    lint = commands.add_parser("lint")
    add_arguments(lint)
    lint.set_defaults(handler=run)
    args = parser.parse_args(["lint", "--format", "json", "hooks.py"])
    assert args.handler(args) == 1
    assert json.loads(capsys.readouterr().out)[0]["rule"] == "SL001"


def test_python_m(project: Path) -> None:
    write(project, "hooks.py", HOOK)
    done = subprocess.run(
        [sys.executable, "-m", "syncless.lint", "hooks.py"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("hooks.py:2:17: SL001 ")


def test_does_not_import_torch(project: Path) -> None:
    # Pure ast: fast enough for pre-commit, and works without torch installed.
    write(project, "hooks.py", HOOK)
    code = (
        "import sys\n"
        "from syncless.lint.cli import main\n"
        "main(['hooks.py'])\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.stdout.splitlines()[-1] == "False", done.stderr
