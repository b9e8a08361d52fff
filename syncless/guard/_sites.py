"""Where a sync came from: the first stack frame outside torch and syncless.guard."""

from __future__ import annotations

import os
import re
import sys
from types import FrameType, TracebackType
from typing import NamedTuple

import torch


class Site(NamedTuple):
    """A call site: file path, line number and the enclosing function's name."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.function}"

    def short_file(self) -> str:
        """The file relative to the working directory when it lies below it."""
        try:
            rel = os.path.relpath(self.file)
        except ValueError:  # another drive on Windows
            return self.file
        return self.file if rel.startswith("..") else rel

    def display(self) -> str:
        """``path:line`` below the working directory, else ``dotted.module:line``."""
        short = self.short_file()
        return f"{short if short != self.file else _module_name(self.file)}:{self.line}"

    def metric_key(self) -> str:
        """A stable, metric-name-safe key: ``<module>.<line>.<function>``.

        ``<module>`` is the file's dotted import path below the longest matching
        ``sys.path`` entry (``pkg.sub.mod``), else the file's stem; characters outside
        ``[A-Za-z0-9_.-]`` become ``_`` so the key passes ``check_metric_name``.
        """
        return _sanitize(f"{_module_name(self.file)}.{self.line}.{self.function}")


UNKNOWN_SITE = Site("<unknown>", 0, "<unknown>")

_SKIP_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def _is_user_file(filename: str) -> bool:
    return not filename.startswith(_SKIP_DIRS)


def user_site() -> Site:
    """The innermost frame of the current stack that belongs to neither torch nor the guard."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if _is_user_file(code.co_filename):
            return Site(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return UNKNOWN_SITE


def traceback_site(tb: TracebackType | None) -> Site:
    """The innermost user frame of a traceback (for errors raised inside torch)."""
    site = UNKNOWN_SITE
    while tb is not None:
        code = tb.tb_frame.f_code
        if _is_user_file(code.co_filename):
            site = Site(code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return site


def _module_name(path: str) -> str:
    """Dotted module path: climb while the directory is a package (has __init__.py).

    Climbing, not matching sys.path: an editable install reaches its package through an
    import hook, so its directory need not be on sys.path.
    """
    directory, filename = os.path.split(os.path.abspath(path))
    parts = [os.path.splitext(filename)[0]]
    while os.path.isfile(os.path.join(directory, "__init__.py")):
        directory, package = os.path.split(directory)
        parts.append(package)
    return ".".join(reversed(parts))


def _sanitize(text: str) -> str:
    return _UNSAFE.sub("_", text)
