"""A run directory the OS refuses: one clear error naming the path and the reason."""

import errno
import os
import pathlib
import shutil
import sys

import pytest

from syncless.errors import UsageError
from syncless.run import Run, RunDirError
from syncless.run.rundir import check_writable

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="needs /proc")


def _refused(match, **run_args):
    with pytest.raises(RunDirError, match=match) as info:
        Run(**run_args)
    assert isinstance(info.value, UsageError)  # the CLI prints it as one line, exit 2
    assert isinstance(info.value.__cause__, OSError)
    assert "\n" not in str(info.value)
    return info.value


@linux_only
def test_a_run_dir_under_proc_names_the_path_and_the_reason():
    err = _refused(
        "cannot create the run directory '/proc/xx-syncless'", run_dir="/proc/xx-syncless"
    )
    assert err.path == pathlib.Path("/proc/xx-syncless")
    assert err.reason == "No such file or directory"
    assert str(err).endswith(
        "choose a writable run directory (`--run-dir DIR`, `Run(run_dir=DIR)`)"
    )


def test_a_run_dir_whose_parent_is_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    run_dir = tmp_path / "file" / "run"
    _refused(f"'{run_dir}': Not a directory", run_dir=run_dir)


def test_a_generated_run_dir_under_a_file_names_the_parent_that_failed(tmp_path):
    (tmp_path / "file").write_text("")
    root = tmp_path / "file" / "runs"
    err = _refused("cannot create the run directory", root=root, name="job")
    assert f"(at '{root}'): Not a directory" in str(err)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_a_run_dir_in_a_read_only_directory(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        _refused(f"'{locked / 'run'}': Permission denied", run_dir=locked / "run")
    finally:
        locked.chmod(0o700)


def test_a_full_disk_while_writing_run_json_leaves_no_partial_file(tmp_path, monkeypatch):
    real_write_bytes = pathlib.Path.write_bytes

    def disk_fills(self, data, *args, **kwargs):
        real_write_bytes(self, data[:10], *args, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pathlib.Path, "write_bytes", disk_fills)
    err = _refused("cannot write run.json in", run_dir=tmp_path / "run")
    assert err.reason == "No space left on device"
    assert list((tmp_path / "run").iterdir()) == []


def test_a_shard_that_cannot_be_written_is_one_line_and_counted(tmp_path, capsys):
    run = Run(run_dir=tmp_path / "run")
    run.log(0, {"test/step/x": 1.0})
    run.flush()
    shutil.rmtree(run.dir / "metrics")
    (run.dir / "metrics").write_text("")  # every later shard fails: Not a directory
    for step in (1, 2):
        run.log(step, {"test/step/x": 1.0})
        run.flush()
    run.log(3, {"test/step/x": 1.0})
    run.close()  # the last batch fails too, and close() does not raise
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # reported once
    shard = run.dir / "metrics" / "rank00000-000002-000002.s1_1.n1.parquet"
    assert f"cannot write the metric shard '{shard}': Not a directory" in err
    assert "Traceback" not in err
    assert run.sink_errors == {"ParquetSink": 3}


def test_check_writable_leaves_no_directory_behind(tmp_path):
    check_writable(tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match="Not a directory"):
        check_writable(tmp_path / "file" / "run")
