"""Files written whole or not at all (syncless.run.atomic)."""

from __future__ import annotations

from pathlib import Path

import pytest

from syncless.run.atomic import replaced_when_written


def test_the_file_takes_its_name_only_when_written(tmp_path: Path) -> None:
    final = tmp_path / "a.bin"
    with replaced_when_written(final) as tmp:
        tmp.write_bytes(b"new")
        assert tmp.name == ".a.bin.tmp" and tmp.parent == tmp_path
        assert not final.exists()  # nobody sees it half written
    assert final.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_a_failed_write_removes_its_temporary_and_keeps_the_old_file(tmp_path: Path) -> None:
    final = tmp_path / "a.bin"
    final.write_bytes(b"old")
    with pytest.raises(OSError, match="No space"), replaced_when_written(final) as tmp:
        tmp.write_bytes(b"partial")
        raise OSError(28, "No space left on device")
    assert final.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]
