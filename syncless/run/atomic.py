"""Files that appear whole or not at all: written under a hidden temporary name beside
their final one, renamed into place when the write succeeds, removed when it fails."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["replaced_when_written"]


@contextmanager
def replaced_when_written(final: Path) -> Iterator[Path]:
    """A temporary path (``.<name>.tmp`` beside ``final``) to write to; it becomes
    ``final`` when the block ends, and is deleted if the block raises.

    Deleted because a write that fails in a living process is most often a full disk:
    a partial file left behind would hold the very space the next write needs (a crash
    still leaves one, which ``syncless check`` lists).
    """
    tmp = final.with_name(f".{final.name}.tmp")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, final)
