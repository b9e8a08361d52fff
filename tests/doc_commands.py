"""Helpers of tests/test_documented_commands.py: the commands the docs show, and running them.

A command is a line of a fenced code block that starts with ``syncless``, ``python``,
``torchrun``, ``pip`` or ``bash`` (after an optional ``$ `` prompt, without a trailing
``# comment``), or an inline code span that starts with ``syncless``, ``python`` or
``torchrun`` (it may wrap lines); whitespace is normalised.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from syncless.run import open as open_run

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCED = ("syncless ", "python ", "torchrun ", "pip ", "bash ")
INLINE = ("syncless ", "python ", "torchrun ")
SYNCLESS = str(Path(sys.executable).with_name("syncless"))
HEADS = {
    "syncless": [SYNCLESS],
    "python": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}
README_RUN = "runs/20261130-101500-demo-tiny"  # README's example run directory
TIMEOUT = 300
DEMO_NAMES = {f"demo/step/{n}" for n in
              ("loss", "balance_loss", "grad_norm", "lr", "step_ms", "tokens_per_s")}  # fmt: skip  # what every demo logs


def extract(text: str) -> list[tuple[int, str]]:
    """(line, command) of every command in one Markdown text."""
    found, prose, fenced = [], [], False
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("```"):
            fenced = not fenced
            prose.append("")
            continue
        prose.append("" if fenced else line)
        s = s.removeprefix("$ ")
        if fenced and s.startswith(FENCED):
            found.append((n, " ".join(re.sub(r"\s+#(\s.*)?$", "", s).split())))
    text = "\n".join(prose)  # inline spans may wrap lines, never cross a fence
    for m in re.finditer(r"(`+)(.+?)\1", text, re.S):
        body = " ".join(m.group(2).split())
        if body.startswith(INLINE) and "\n\n" not in m.group(2):
            found.append((text.count("\n", 0, m.start()) + 1, body))
    return found


def documented_commands() -> dict[str, list[str]]:
    """command -> the places ("docs/run.md:68") that show it."""
    out: dict[str, list[str]] = {}
    for path in DOCS:
        for n, cmd in extract(path.read_text()):
            out.setdefault(cmd, []).append(f"{path.relative_to(ROOT)}:{n}")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Ctx:
    """One documented command, run in its own directory ``cwd``."""

    command: str
    cwd: Path
    request: pytest.FixtureRequest

    def argv(self, steps: int = 3, **subs: str) -> list[str]:
        """The command's argv: the venv's executables; ``--preset small/large`` -> tiny,
        ``--nproc-per-node 8`` -> 2, ``RUN_DIR`` (and README's run) -> the shared demo
        run, ``subs``, repository paths -> absolute ones, ``--steps`` after a demo."""
        words = shlex.split(self.command)
        out, prev = list(HEADS[words[0]]), None
        for w in words[1:]:
            if prev == "--preset" and w in ("small", "large"):
                w = "tiny"
            elif prev == "--nproc-per-node" and w == "8":
                w = "2"
            elif w in ("RUN_DIR", README_RUN):
                w = str(self.request.getfixturevalue("shared_run"))
            elif w in subs:
                w = subs[w]
            elif w.split("/")[0] in ("examples", "bench", "tests", "syncless"):
                w = str(ROOT / w)
            out.append(w)
            prev = w
        demo = words[:2] == ["syncless", "demo"] or "syncless.demo" in words
        return [*out, "--steps", str(steps)] if demo and "--help" not in words else out

    def run(self, argv: list[str], status: int = 0, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` in ``cwd``; assert its exit status."""
        kw.setdefault("stdout", subprocess.PIPE)
        env = {**os.environ, "PET_MASTER_PORT": str(free_port())}  # torchrun's, not 29500
        if any(a.startswith("bench.") for a in argv[:3]):  # python -m bench.<suite> CASE
            # runs from the repository root (bench/README.md); here from cwd, so the root
            # goes on PYTHONPATH instead.
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        p = subprocess.run(argv, cwd=self.cwd, stderr=subprocess.PIPE, text=True,
                           timeout=TIMEOUT, env=env, **kw)  # fmt: skip
        assert p.returncode == status, (
            f"{shlex.join(argv)} (documented as {self.command!r}) exited {p.returncode}, "
            f"expected {status}\n--- stdout\n{(p.stdout or '')[-4000:]}\n"
            f"--- stderr\n{p.stderr[-4000:]}"
        )
        return p

    def demo(self, steps: int = 3) -> tuple[subprocess.CompletedProcess, Path]:
        """Run a demo command; return it and the one run directory it made under runs/."""
        p = self.run(self.argv(steps))
        made = sorted((self.cwd / "runs").iterdir())
        assert len(made) == 1, made
        return p, made[0]


def sql(run_dir: Path | str, query: str) -> list[tuple]:
    with open_run(str(run_dir)) as store:
        return store.query(query)[1]


def steps_of(run_dir: Path, like: str) -> dict[str, list[int]]:
    """name -> its sorted distinct steps, for the names matching ``like``."""
    rows = sql(run_dir, f"SELECT name, list(DISTINCT step ORDER BY step) FROM metrics "
                        f"WHERE name LIKE '{like}' GROUP BY name")  # fmt: skip
    return {name: list(steps) for name, steps in rows}


def table_rows(out: str) -> list[list[str]]:
    """The body rows of a `syncless query` table."""
    return [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines()
            if line.startswith("│")]  # fmt: skip


RUN: dict[str, Callable[[Ctx], None]] = {}  # command -> its check


def runs(*commands: str):
    """Register the decorated check for each of ``commands``, as the docs spell them."""

    def register(fn):
        for command in commands:
            RUN[command] = fn
        return fn

    return register


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("shared") / "run"
    argv = [SYNCLESS, "demo", "--steps", "3", "--run-dir", str(run_dir), "--quiet"]
    p = subprocess.run(argv, cwd=run_dir.parent, capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    return run_dir
