"""Configuration from ``[tool.syncless.lint]`` in ``pyproject.toml``.

::

    [tool.syncless.lint]
    hot-path-patterns = ["on_step_*", "Monitor.record"]   # extra fnmatch globs of names
    exclude = ["tests/lint/cases", "**/generated"]        # globs of paths to skip
    ignore = ["SL009"]                                    # rule codes (or prefixes) to drop
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as _toml
    except ModuleNotFoundError:
        _toml = None

SECTION = "tool.syncless.lint"
_KEYS = {"hot-path-patterns": "hot_path_patterns", "exclude": "exclude", "ignore": "ignore"}


class ConfigError(Exception):
    """The configuration file is missing, unreadable or invalid."""


@dataclass(frozen=True)
class LintConfig:
    """What to lint and how.

    ``root`` anchors the ``exclude`` globs (the directory of the pyproject.toml they
    came from; the current directory when None). ``source`` is that file, if any.
    """

    hot_path_patterns: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    root: Path | None = None
    source: Path | None = None

    def extended(
        self,
        *,
        hot_path_patterns: tuple[str, ...] = (),
        exclude: tuple[str, ...] = (),
        ignore: tuple[str, ...] = (),
    ) -> LintConfig:
        """A copy with more patterns, excludes and ignored codes (from the command line)."""
        return replace(
            self,
            hot_path_patterns=self.hot_path_patterns + tuple(hot_path_patterns),
            exclude=self.exclude + tuple(exclude),
            ignore=self.ignore + tuple(ignore),
        )

    def ignores(self, rule: str) -> bool:
        """Whether findings of ``rule`` are dropped (``ignore`` holds codes or prefixes)."""
        return any(rule.startswith(code) for code in self.ignore)


def find_pyproject(start: str | os.PathLike[str] | None = None) -> Path | None:
    """The nearest ``pyproject.toml`` in ``start`` (default: the cwd) or its parents."""
    directory = Path(start if start is not None else os.getcwd()).absolute()
    for candidate in (directory, *directory.parents):
        path = candidate / "pyproject.toml"
        if path.is_file():
            return path
    return None


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    start: str | os.PathLike[str] | None = None,
) -> LintConfig:
    """Read ``[tool.syncless.lint]`` from ``path``, or from the nearest pyproject.toml.

    Without ``path`` the search starts at ``start`` (default: the current directory);
    no file, or a file without the section, gives the defaults. Raises
    :class:`ConfigError` for a missing ``path``, invalid TOML, unknown keys or values
    of the wrong type.
    """
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file not found: {file}")
    else:
        found = find_pyproject(start)
        if found is None:
            return LintConfig()
        file = found
    section = _read_section(file)
    values: dict[str, tuple[str, ...]] = {}
    for key, value in section.items():
        if key not in _KEYS:
            known = ", ".join(sorted(_KEYS))
            raise ConfigError(f"{file}: unknown key {key!r} in [{SECTION}] (known: {known})")
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{file}: [{SECTION}] {key} must be a list of strings")
        values[_KEYS[key]] = tuple(value)
    return LintConfig(**values, root=file.absolute().parent, source=file)


def _read_section(file: Path) -> dict[str, Any]:
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {file}: {error}") from error
    if _toml is None:
        if "[tool.syncless" not in text:
            return {}
        raise ConfigError(
            f"reading [{SECTION}] from {file} needs the 'tomli' package on Python 3.10 "
            "(pip install tomli)"
        )
    try:
        data = _toml.loads(text)
    except _toml.TOMLDecodeError as error:
        raise ConfigError(f"{file}: invalid TOML: {error}") from error
    section: Any = data
    for part in SECTION.split("."):
        section = section.get(part, {}) if isinstance(section, dict) else {}
    if not isinstance(section, dict):
        raise ConfigError(f"{file}: [{SECTION}] must be a table")
    return section
