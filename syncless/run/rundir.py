"""The run directory: where every number of a run lands.

Layout::

    runs/<YYYYmmdd-HHMMSS>-<name>[-N]/
        run.json               config, versions, world size, host, git commit (rank 0),
                               and a segment per start (the first, then each resume)
        metrics/rank00000-000001.parquet   step records, one shard per batch per rank

Every run gets a directory of its own: :func:`make_unique_dir` claims a generated name
(with a ``-2``, ``-3``, ... suffix on a collision), :func:`claim_run_dir` refuses a
named one that already holds something unless the run resumes it. An OSError while
creating or writing it becomes a :class:`RunDirError`: one line, the path and the reason.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from syncless.errors import UsageError
from syncless.run.shards import list_folder
from syncless.run.storage import (
    RunPath,
    exists,
    is_remote,
    list_files,
    read_metadata,
    read_table,
    run_path,
    write_exclusive,
    write_whole,
)

RUN_JSON = "run.json"
METRICS_DIR = "metrics"
FORMAT = "syncless-run/1"


#: Where generated run directories go, relative to the working directory.
DEFAULT_ROOT = "runs"

#: How many ``-N`` suffixes a generated name tries before giving up.
MAX_SUFFIX = 1000

#: What a :class:`RunDirError` at the start of a run tells the user to do.
CHOOSE_ANOTHER = "choose a writable run directory (`--run-dir DIR`, `Run(run_dir=DIR)`)"


class RunDirError(UsageError):
    """The operating system refused to create or write the run directory.

    The message names what was being done, the path and the OS's reason, on one line;
    the OSError is the ``__cause__``. A :class:`~syncless.errors.UsageError`, so the CLI
    prints it as ``syncless: error: ...`` and exits 2.

    Example::

        try:
            run = Run(run_dir="/proc/my-run")
        except RunDirError as e:
            print(e)  # cannot create the run directory '/proc/my-run': No such file ...

    Args:
        action: what failed, completing "cannot ...", e.g. "create the run directory".
        path: the directory or file it failed on.
        error: the OSError.
        advice: what to do about it.
    """

    def __init__(
        self, action: str, path: str | os.PathLike, error: OSError, advice: str = CHOOSE_ANOTHER
    ) -> None:
        self.path = run_path(path)
        # pyarrow puts its own words in strerror; the errno's are the ones users know.
        self.reason = os.strerror(error.errno) if error.errno else str(error)
        where = ""
        failed = Path(error.filename) if isinstance(error.filename, str) else None
        if failed is not None and not is_remote(self.path) and failed in self.path.parents:
            where = f" (at {str(failed)!r})"  # a parent, made on the way
        super().__init__(f"cannot {action} {str(self.path)!r}{where}: {self.reason}; {advice}")


def default_run_dir(name: str, root: str | os.PathLike = DEFAULT_ROOT) -> RunPath:
    return run_path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"


def make_unique_dir(proposed: RunPath) -> RunPath:
    """Create ``proposed``, or else the first free of ``proposed-2``, ``proposed-3``, ...

    ``mkdir`` without ``exist_ok`` is the claim: atomic between processes, so two runs
    started in the same second, which generate the same name, get two directories. An
    object store has no directories: the first prefix that holds nothing is taken, and
    ``run.json``'s exclusive creation is the claim (the second of two runs that chose
    the same prefix in the same instant gets a UsageError).
    """
    if is_remote(proposed):
        for n in range(1, MAX_SUFFIX + 1):
            path = proposed if n == 1 else proposed.with_name(f"{proposed.name}-{n}")
            if not exists(path):
                return path
        raise UsageError(
            f"{MAX_SUFFIX} run directories named {str(proposed)!r}[-N] exist already; "
            "pass a run name or directory of your own"
        )
    try:
        proposed.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError("create the run directory", proposed, e) from e
    for n in range(1, MAX_SUFFIX + 1):
        path = proposed if n == 1 else proposed.with_name(f"{proposed.name}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            raise RunDirError("create the run directory", path, e) from e
        return path
    raise UsageError(
        f"{MAX_SUFFIX} run directories named {str(proposed)!r}[-N] exist already; "
        "pass a run name or directory of your own"
    )


def claim_run_dir(path: RunPath, resume: bool) -> bool:
    """Make ``path``, a directory the user named, this run's; True if it resumes a run.

    Creating it is the claim (in an object store, creating ``run.json``). An existing
    one goes through :func:`check_run_dir`.
    """
    if is_remote(path):
        return check_run_dir(path, resume)
    try:
        path.mkdir(parents=True)
    except FileExistsError:
        return check_run_dir(path, resume)
    except OSError as e:
        raise RunDirError("create the run directory", path, e) from e
    return False


def check_run_dir(path: RunPath, resume: bool) -> bool:
    """Whether a run may start in ``path``; True if it would resume the run there.

    A missing or empty directory starts a new run. One that holds a run is refused
    unless ``resume`` (a new segment of that run); one that holds anything else is
    refused either way, so two runs' steps never mix in one directory.
    """
    try:
        return _check_run_dir(path, resume)
    except OSError as e:
        raise RunDirError("read the run directory", path, e) from e


def _check_run_dir(path: RunPath, resume: bool) -> bool:
    if not exists(path):
        return False
    if not path.is_dir():
        raise UsageError(f"run directory {str(path)!r} exists and is not a directory")
    if resume and (path / RUN_JSON).is_file():
        read_run_json(path)  # a clear error if it is not a syncless run
        return True
    held = _contents(path)
    if not held:
        return False
    if resume:
        raise UsageError(
            f"cannot resume {str(path)!r}: it holds {held} but no {RUN_JSON}, so it is not "
            "a syncless run; choose another directory"
        )
    raise UsageError(
        f"run directory {str(path)!r} already holds {held}: a second run would mix its "
        "steps into it; resume it (`syncless demo --resume`, `Run(resume=True)`) to add a "
        "segment, or choose a new directory (or none, for a fresh one under runs/)"
    )


def check_writable(path: Path) -> None:
    """Raise :class:`RunDirError` unless ``path`` can be created or, if it exists, written.

    For a launcher that leaves the claim to the ranks it starts: every directory made
    here is removed again, so that one line stops the launch, not one error per rank.
    An object store is not tried here (a write would leave an object behind): the
    ranks' first write says what is wrong.
    """
    if is_remote(path):
        return
    try:
        made = [p for p in (path, *path.parents) if not p.exists()]
        if made:
            path.mkdir(parents=True)
        else:
            tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        action = "create the run directory" if not path.is_dir() else "write in the run directory"
        raise RunDirError(action, path, e) from e
    for directory in made:  # deepest first
        try:
            directory.rmdir()
        except OSError:
            break  # taken meanwhile: it is no longer ours to remove


def _contents(path: RunPath) -> str:
    """What ``path`` holds, in words; "" when empty (an empty metrics/ counts as empty:
    another rank may have made it already)."""
    entries = [p for p in path.iterdir() if not (p.name == METRICS_DIR and _empty(p))]
    if (path / RUN_JSON).is_file():
        shards = sum(n.endswith(".parquet") for n in list_files(path / METRICS_DIR))
        return f"a run ({RUN_JSON}, {shards} metric shard(s))"
    return f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}" if entries else ""


def _empty(path: RunPath) -> bool:
    return path.is_dir() and not any(path.iterdir())


def environment() -> dict[str, Any]:
    """Versions and host facts worth keeping next to every number."""
    import torch

    import syncless

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "syncless": syncless.__version__,
        "cuda": torch.version.cuda,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "argv": sys.argv,
        "git_commit": git_commit(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    """The commit of the working directory's git checkout, or None outside one."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def write_run_json(run_dir: RunPath, meta: dict[str, Any], exclusive: bool = False) -> None:
    """Write ``run.json`` whole (syncless.run.storage: a rename, or one PUT).

    ``exclusive``: only if there is none yet, so of two runs starting in one empty
    directory, the second gets a UsageError.
    """
    doc = meta if "format" in meta else {"format": FORMAT, **meta}
    data = (json.dumps(doc, indent=2, default=str) + "\n").encode()
    try:
        if exclusive:
            write_exclusive(run_dir / RUN_JSON, data)
        else:
            write_whole(run_dir / RUN_JSON, data)
    except FileExistsError:
        raise UsageError(
            f"another run started in {str(run_dir)!r} at the same time; choose a new directory"
        ) from None
    except OSError as e:
        raise RunDirError(f"write {RUN_JSON} in", run_dir, e) from e


def read_run_json(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Read a run's ``run.json``; raise UsageError if ``run_dir`` is not a syncless run."""
    path = run_path(run_dir)
    if not path.is_dir():
        raise UsageError(f"run directory {str(path)!r} does not exist")
    meta_path = path / RUN_JSON
    if not meta_path.is_file():
        raise UsageError(
            f"{str(path)!r} is not a syncless run: it has no {RUN_JSON}. "
            "Pass a directory created by `syncless demo` or `syncless.run.Run` "
            "(by default under ./runs/)."
        )
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{str(meta_path)!r} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UsageError(
            f"{str(meta_path)!r} is not a syncless run file "
            f"(expected format {FORMAT!r}, found {meta.get('format') if isinstance(meta, dict) else None!r})"
        )
    return meta


def new_segment(world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """One start of a run: when, on how many ranks, with what config, seed and argv.

    ``first_step`` is filled in by the first record the segment logs.
    """
    return {
        "start_time": time.time(),
        "world_size": world_size,
        "seed": config.get("seed"),
        "first_step": None,
        "config": config,
        "env": environment(),
    }


def start_segment(run_dir: RunPath, name: str, segment: dict[str, Any], resumed: bool) -> None:
    """Record a start in ``run.json``: a new run's first segment, or one more segment of
    a resumed run (earlier segments are kept; the top-level keys stay the first's)."""
    if not resumed:
        first = {k: segment[k] for k in ("start_time", "world_size", "config", "env")}
        meta = {"name": name, **first, "segments": [segment]}
        write_run_json(run_dir, meta, exclusive=True)
        return
    meta = read_run_json(run_dir)
    # A run.json from before segments: its top-level keys were its one segment.
    earlier = meta.get("segments") or [
        {k: meta.get(k) for k in ("start_time", "world_size", "config", "env")}
    ]
    meta["segments"] = [*earlier, segment]
    write_run_json(run_dir, meta)


def set_first_step(run_dir: RunPath, step: int) -> None:
    """Fill in the latest segment's ``first_step``."""
    meta = read_run_json(run_dir)
    if meta.get("segments"):
        meta["segments"][-1]["first_step"] = step
        write_run_json(run_dir, meta)


def last_step(run_dir: RunPath) -> int | None:
    """The highest step in the run's readable metric shards, None when it has none.

    A resume most often follows a crash, which is when a shard is cut short: an
    unreadable one is skipped with a warning naming it (``syncless check`` reports it),
    so the run goes on from the last step it can prove it stored.
    """
    import pyarrow as pa

    # Highest first by what the names say (unnamed shards: by their footer), each
    # checked by its footer: the first readable one is the answer, so a resume reads a
    # footer or two, not one per shard.
    folder = run_dir / METRICS_DIR
    shards = list_folder(folder).visible
    named = sorted(
        ((s.last_step, name) for name, s in shards if s.last_step is not None), reverse=True
    )
    candidates = [(None, name) for name, s in shards if s.last_step is None] + named
    best: int | None = None
    for said, name in candidates:
        if said is not None and best is not None and said <= best:
            break  # nothing further down the list is higher
        try:
            high = _shard_last_step(folder / name)
        except (OSError, pa.ArrowException, ValueError) as e:
            logging.getLogger(__name__).warning(
                "resume: skipped unreadable shard %s (%s); `syncless check %s` reports it",
                folder / name,
                str(e).splitlines()[0] if str(e) else type(e).__name__,
                run_dir,
            )
            continue
        if high is not None and (best is None or high > best):
            best = high
    return best


def _shard_last_step(shard: RunPath) -> int | None:
    import pyarrow.compute as pc

    # Row-group statistics: no column data read, ~0.2 ms a shard.
    meta = read_metadata(shard)
    step_col = meta.schema.names.index("step")
    best: int | None = None
    for i in range(meta.num_row_groups):
        stats = meta.row_group(i).column(step_col).statistics
        if stats is not None and stats.has_min_max:
            high = int(stats.max)
        else:
            high = pc.max(read_table(shard, columns=["step"])["step"]).as_py()
        if high is not None and (best is None or high > best):
            best = high
    return best
