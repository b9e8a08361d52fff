"""The run directory: where every number of a run lands.

Layout::

    runs/<YYYYmmdd-HHMMSS>-<name>/
        run.json               config, versions, world size, host, git commit (rank 0)
        metrics/rank00000-000001.parquet   step records, one shard per batch per rank
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from syncless.errors import UsageError

RUN_JSON = "run.json"
METRICS_DIR = "metrics"
FORMAT = "syncless-run/1"


def default_run_dir(name: str, root: str | os.PathLike = "runs") -> Path:
    return Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"


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


def write_run_json(run_dir: Path, meta: dict[str, Any]) -> None:
    """Write ``run.json`` atomically (temp name, then rename)."""
    doc = {"format": FORMAT, **meta}
    tmp = run_dir / f".{RUN_JSON}.tmp"
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    os.replace(tmp, run_dir / RUN_JSON)


def read_run_json(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Read a run's ``run.json``; raise UsageError if ``run_dir`` is not a syncless run."""
    path = Path(run_dir)
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
