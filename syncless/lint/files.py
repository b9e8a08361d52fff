"""Which files a lint run covers: walking directories and applying excludes.

Exclude globs are matched with :func:`fnmatch.fnmatchcase` against the path relative
to the config's root, written with ``/``:

- a glob with a ``/`` is anchored at the root and matches the path or any of its
  parent directories (``tests/lint/cases`` excludes everything below it);
- a glob starting with ``**/`` matches at any depth (``**/generated``);
- a glob without ``/`` matches any single path component (``*_pb2.py``, ``vendor``).

Excludes apply to explicitly named files too, so that pre-commit (which passes file
names) honours them. Directory walks also skip hidden directories (``.venv``,
``.git``), ``venv``, ``__pycache__``, ``site-packages``, ``node_modules`` and
``*.egg-info``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from fnmatch import fnmatchcase
from pathlib import Path

from syncless.lint.config import LintConfig
from syncless.lint.findings import LintError

SKIPPED_DIRS = frozenset({"__pycache__", "build", "dist", "node_modules", "venv", "site-packages"})


def is_excluded(path: Path, config: LintConfig) -> bool:
    """Whether ``path`` matches one of ``config.exclude``."""
    if not config.exclude:
        return False
    root = (config.root or Path.cwd()).absolute()
    absolute = Path(os.path.abspath(path))
    try:
        parts = absolute.relative_to(root).parts
    except ValueError:
        parts = tuple(p for p in Path(path).parts if p not in ("/", "."))
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in config.exclude:
        pattern = pattern.removeprefix("./").rstrip("/")
        if pattern.startswith("**/"):
            tail = pattern[3:]
            subpaths = (
                "/".join(parts[i : j + 1]) for i in range(len(parts)) for j in range(i, len(parts))
            )
            if any(fnmatchcase(sub, tail) for sub in subpaths):
                return True
        elif "/" in pattern:
            if any(fnmatchcase(prefix, pattern) for prefix in prefixes):
                return True
        elif any(fnmatchcase(part, pattern) for part in parts):
            return True
    return False


def collect_files(
    paths: Iterable[str | os.PathLike[str]], config: LintConfig
) -> tuple[list[Path], list[LintError]]:
    """The Python files under ``paths`` (in order, without duplicates) and path errors."""
    files: list[Path] = []
    errors: list[LintError] = []
    seen: set[str] = set()

    def add(file: Path) -> None:
        key = os.path.realpath(file)
        if key not in seen and not is_excluded(file, config):
            seen.add(key)
            files.append(file)

    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            if not is_excluded(path, config):
                for file in _walk(path, config):
                    add(file)
        elif path.is_file():
            add(path)
        else:
            errors.append(LintError(str(path), "no such file or directory"))
    return files, errors


def _walk(directory: Path, config: LintConfig) -> Iterable[Path]:
    for current, dirs, names in os.walk(directory):
        base = Path(current)
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".")
            and d not in SKIPPED_DIRS
            and not d.endswith(".egg-info")
            and not is_excluded(base / d, config)
        )
        for name in sorted(names):
            if name.endswith(".py"):
                yield base / name
