"""Reading [tool.syncless.lint] and matching exclude globs."""

from __future__ import annotations

from pathlib import Path

import pytest

from syncless.lint import ConfigError, LintConfig, find_pyproject, load_config
from syncless.lint.files import is_excluded


def test_defaults_without_file(tmp_path: Path) -> None:
    if find_pyproject(tmp_path) is not None:
        pytest.skip("a parent of the temporary directory has a pyproject.toml")
    assert load_config(start=tmp_path) == LintConfig()


def test_reads_section(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        "[project]\nname = 'x'\n\n[tool.syncless.lint]\n"
        'hot-path-patterns = ["on_*"]\nexclude = ["gen"]\nignore = ["SL009"]\n'
    )
    (tmp_path / "a" / "b").mkdir(parents=True)
    config = load_config(start=tmp_path / "a" / "b")
    assert config.hot_path_patterns == ("on_*",)
    assert config.exclude == ("gen",)
    assert config.ignore == ("SL009",)
    assert config.root == tmp_path.absolute()
    assert config.source == tmp_path / "pyproject.toml"


def test_section_absent_gives_defaults(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.ruff]\nline-length = 100\n")
    config = load_config(start=tmp_path)
    assert config.hot_path_patterns == ()
    assert config.root == tmp_path.absolute()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[tool.syncless.lint]\npatterns = ["x"]\n', "unknown key 'patterns'"),
        ('[tool.syncless.lint]\nexclude = "x"\n', "exclude must be a list of strings"),
        ("[tool.syncless.lint]\nignore = [1]\n", "ignore must be a list of strings"),
        ("[tool.syncless.lint\n", "invalid TOML"),
    ],
)
def test_invalid(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_missing_explicit_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_extended_and_ignores() -> None:
    config = LintConfig(ignore=("SL00",)).extended(hot_path_patterns=("a",), ignore=("SL101",))
    assert config.hot_path_patterns == ("a",)
    assert config.ignores("SL004") and config.ignores("SL101") and not config.ignores("SL100")


@pytest.mark.parametrize(
    ("pattern", "path", "excluded"),
    [
        ("tests/lint/cases", "tests/lint/cases/sl001.py", True),
        ("tests/lint/cases", "tests/lint/cases", True),
        ("tests/lint/cases", "other/tests/lint/cases/x.py", False),
        ("tests/*/cases", "tests/lint/cases/x.py", True),
        ("**/generated", "a/b/generated/x.py", True),
        ("**/generated", "generated/x.py", True),
        ("**/generated", "a/generated_not/x.py", False),
        ("*_pb2.py", "deep/api_pb2.py", True),
        ("vendor", "src/vendor/lib.py", True),
        ("vendor", "src/vendored/lib.py", False),
        ("src/", "src/x.py", True),
        ("./src", "src/x.py", True),
    ],
)
def test_exclude_globs(tmp_path: Path, pattern: str, path: str, excluded: bool) -> None:
    config = LintConfig(exclude=(pattern,), root=tmp_path)
    assert is_excluded(tmp_path / path, config) is excluded
