"""What every suite shares: its entry point, interleaved rounds, RESULTS.md lines.

- ``suite_main``: a suite's ``python -m bench.<suite> CASE [ARGS...]``; no CASE (or
  ``--list``) lists the cases, each with its docstring's first paragraph.
- ``interleave``: rounds in which every contestant runs once, in an order rotated by
  the round, so a drift of the machine hits each alike; ``by_name``, ``round_ratios``,
  ``round_overheads`` and ``spread`` summarise them (``median [min..max] (n)``).
- ``relaunch``: a case again on N local ranks under torchrun, as ``--worker``s.
- ``append_result``: one line of bench/RESULTS.md (date, device, torch, commit, the
  benchmark's name, its result); ``metric_values`` reads a run's shards back and
  ``syncless_argv`` is the ``syncless`` command as users run it.

Nothing here imports torch, pyarrow or syncless before a function needs them: listing a
suite's cases stays instant.
"""

from __future__ import annotations

import ast
import datetime
import importlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

RESULTS = Path(__file__).with_name("RESULTS.md")
T = TypeVar("T")

# ---- a suite's entry point -----------------------------------------------------------


def cases(package: str) -> dict[str, str]:
    """The cases of suite ``package`` (``bench.capture``): its modules that define a
    top-level ``main``, each with its docstring's first paragraph on one line. Read from
    the source, not imported, so a case's heavy imports load only when it runs."""
    folder = Path(__file__).parent.joinpath(*package.split(".")[1:])
    out = {}
    for path in sorted(folder.glob("*.py")):
        if path.name.startswith("_"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            doc = ast.get_docstring(tree) or ""
            out[path.stem] = " ".join(doc.split("\n\n")[0].split())
    return out


def suite_main(package: str, argv: Sequence[str] | None = None) -> None:
    """``python -m bench.<suite> CASE [ARGS...]``: the case module's ``main(ARGS)``.
    Without a CASE, or with ``--list`` / ``-h`` / ``--help``, the list of cases."""
    argv = list(sys.argv[1:] if argv is None else argv)
    found = cases(package)
    if not argv or argv[0] in ("--list", "-h", "--help"):
        print(listing(package, found))
        return
    name, rest = argv[0], argv[1:]
    if name not in found:
        print(f"{package}: no case {name!r}\n\n{listing(package, found)}", file=sys.stderr)
        raise SystemExit(2)
    sys.argv = [f"python -m {package} {name}", *rest]  # argparse's prog, a case's argv
    importlib.import_module(f"{package}.{name}").main(rest)


def listing(package: str, found: Mapping[str, str]) -> str:
    suite = importlib.import_module(package)
    title = (suite.__doc__ or package).strip().splitlines()[0]
    width = max(map(len, found), default=0)
    rows = [f"  {name:<{width}}  {about}" for name, about in found.items()]
    usage = f"usage: python -m {package} CASE [ARGS...]   (CASE --help: its arguments)"
    return "\n".join([f"{package}: {title}", usage, "", "cases:", *rows])


# ---- interleaved rounds --------------------------------------------------------------

Rounds = list[dict[str, list[float]]]
"""Per round: each mode's wall seconds per timed step (what ``interleave`` returns when
each contestant times a segment of steps)."""


def rotated(names: Sequence[T], r: int) -> list[T]:
    """``names`` in round ``r``'s order: each leads one round in turn."""
    k = r % len(names) if names else 0
    return [*names[k:], *names[:k]]


def interleave(
    contestants: Mapping[str, Callable[[], T | None]],
    rounds: int,
    *,
    rotate: bool = True,
    deadline: float | None = None,
    after_round: Callable[[int, dict[str, T], float], None] | None = None,
) -> list[dict[str, T]]:
    """``rounds`` rounds in which each contestant is called once; per round, what each
    returned, by name.

    ``rotate``: the order rotates by the round (``rotated``), else it stays as given.
    A contestant that returns None is left out of that round (it failed, or is done).
    ``deadline`` (``time.perf_counter()``): no round starts that would end past it, by
    the last round's length; the first always runs. ``after_round(r, results,
    seconds)`` runs after each round (a progress line)."""
    names = list(contestants)
    done: list[dict[str, T]] = []
    last_round_s = 0.0
    for r in range(rounds):
        if deadline is not None and done and time.perf_counter() + last_round_s > deadline:
            print(f"  time is up after {len(done)} round(s)")
            break
        start = time.perf_counter()
        results: dict[str, T] = {}
        for name in rotated(names, r) if rotate else names:
            got = contestants[name]()
            if got is not None:
                results[name] = got
        done.append(results)
        last_round_s = time.perf_counter() - start
        if after_round is not None:
            after_round(r, results, last_round_s)
    return done


def by_name(rounds: Sequence[Mapping[str, T]]) -> dict[str, list[T]]:
    """The rounds turned around: each name's results, round after round."""
    out: dict[str, list[T]] = {}
    for results in rounds:
        for name, got in results.items():
            out.setdefault(name, []).append(got)
    return out


def round_ratios(rounds: Rounds, mode: str, reference: str = "off") -> list[float]:
    """Per round: mean step of ``mode`` over the mean ``reference`` step of that round."""
    out = []
    for times in rounds:
        if times.get(mode) and times.get(reference):
            out.append(statistics.fmean(times[mode]) / statistics.fmean(times[reference]))
    return out


def round_overheads(rounds: Rounds, mode: str, reference: str = "off") -> list[float]:
    return [r - 1 for r in round_ratios(rounds, mode, reference)]


def spread(values: Sequence[float], scale: float = 100.0, unit: str = "%", sign: str = "+") -> str:
    """``median [min..max] (n)`` of per-round figures, each ``* scale`` with ``unit``
    after the median: ``+0.42% [-0.10..+0.90] (4)``, or ``1.83x [1.80..1.85] (4)`` with
    ``scale=1, unit="x", sign=""``."""
    med, lo, hi = (f"{v * scale:{sign}.2f}" for v in (statistics.median(values), min(values),
                                                     max(values)))  # fmt: skip
    return f"{med}{unit} [{lo}..{hi}] ({len(values)})"


# ---- several ranks -------------------------------------------------------------------


def relaunch(case: str, nproc: int, argv: Sequence[str] | None, *extra: str) -> int:
    """Run case module ``case`` (a ``__name__``: ``bench.demo.pacing_ep``) on ``nproc``
    local ranks under torchrun, each as ``python -m bench.demo pacing_ep --worker
    <argv> <extra>`` (``argv`` None: this process's ``sys.argv[1:]``); its exit
    status.

    ``--nproc`` is not forwarded: torchrun reads it as an abbreviation of its own
    ``--nproc-per-node``, even after the module's name.
    """
    from syncless.demo.launch import strip_nproc

    suite, _, name = case.rpartition(".")
    forwarded = strip_nproc(sys.argv[1:] if argv is None else argv)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", suite, name, "--worker", *forwarded, *extra]  # fmt: skip
    return subprocess.call(cmd)


# ---- RESULTS.md ----------------------------------------------------------------------


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"{n}x {torch.cuda.get_device_name()}"
    return f"CPU ({os.cpu_count()} cores)"


def commit() -> str:
    env = os.environ.get("SYNCLESS_COMMIT")  # the device machine's copy has no .git
    if env:
        return env
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    # RESULTS.md itself changes with every append: not a code change. Untracked files
    # count (a new benchmark script is part of what was measured).
    status = ["git", "status", "--porcelain", "--", ".", ":!*RESULTS.md"]
    dirty = subprocess.run(status, capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def metric_values(run_dir: Path, name: str, first_step: int = 0, rank: int = 0) -> list[float]:
    """One metric of one rank from a run's shards, in step order (pyarrow only: the GPU
    image has no DuckDB)."""
    import pyarrow.parquet as pq

    rows = []
    for shard in sorted((Path(run_dir) / "metrics").glob(f"rank{rank:05d}-*.parquet")):
        rows += [
            (r["step"], r["value"])
            for r in pq.read_table(shard).to_pylist()
            if r["name"] == name and r["step"] >= first_step
        ]
    return [v for _, v in sorted(rows)]


def append_result(bench: str, result: str, path: Path | None = None) -> str:
    import torch

    line = (
        f"- {datetime.date.today().isoformat()} | {device_name()} | torch {torch.__version__} | "
        f"{commit()} | {bench} | {result}"
    )
    target = path or Path(os.environ.get("SYNCLESS_RESULTS", RESULTS))
    with target.open("a") as f:
        f.write(line + "\n")
    return line


def syncless_argv() -> list[str]:
    """The ``syncless`` command as users run it: the script pip installed next to this
    Python, else ``python -m syncless.cli``."""
    script = Path(sys.executable).with_name("syncless")
    return [str(script)] if script.exists() else [sys.executable, "-m", "syncless.cli"]
