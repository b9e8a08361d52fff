"""The capture benchmarks on two source trees, interleaved: before and after a change.

Each benchmark runs as its own process, once per tree, in the order before, after,
after, before (so a drift of the machine over the call hits both alike), with
``PYTHONPATH`` set to the tree: the ``syncless`` package is the tree's, the benchmark
cases are this suite's for both (``python -m bench.capture CASE``, run from a folder that
holds only a link to this ``bench/``). The three benchmarks:

- ``capture_drain``: unconstrained drain rate against the pinned D2H bandwidth, and the
  host time of one 4 KiB ``capture()``;
- ``capture_host``: ``capture()``'s host time per call, 4 KiB, with and without the
  engine's threads, deferred and copy-skipped;
- ``capture_load``: every layer's hidden state of a GPU-bound llama-1b
  (bench/stacks/hf_models.py) captured every step, ``null`` (every layer) and ``mixed``
  (plus 16 small rows per layer), against ``off``: step overhead and host us per call.

Every run's output goes to ``$OUT/<benchmark>-<n>-<tree>.log``; ``$OUT/before_after.md``
holds a table of the key numbers, before and after, and the lines to copy into
bench/RESULTS.md. Nothing is appended to RESULTS.md here. About 5 minutes on one
H100 or H200; ``--tiny`` runs everything small on the CPU (a smoke test: the numbers
mean nothing).

    mkdir -p .before && git archive <commit before> syncless | tar -x -C .before
    BEFORE=.before AFTER=. OUT=/tmp/ba python -m bench.capture before_after
    BEFORE=.before AFTER=. OUT=/tmp/ba python -m bench.capture before_after --tiny
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import functools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]  # bench/
ORDER = ("before", "after", "after", "before")

# Arguments per benchmark: on the GPU (kept short, so the whole call fits in minutes),
# and --tiny on the CPU.
ARGS = {
    "capture_drain": (
        ["--reps", "3", "--total-gb", "8", "--no-record"],
        ["--reps", "1", "--total-gb", "0.02", "--record-mb", "0.25", "--no-record"],
    ),
    "capture_host": (["--no-record"], ["--calls", "200", "--no-record"]),
    "capture_load": (
        [
            *("--modes", "off,null,mixed", "--rounds", "2", "--warmup", "3", "--seg", "10"),
            *("--skip-disk", "--budget-s", "120", "--no-append"),
        ],
        [
            *("--tiny", "--layers", "2", "--modes", "off,null,mixed", "--rounds", "1"),
            *("--warmup", "1", "--seg", "2", "--skip-disk", "--budget-s", "60", "--no-append"),
        ],
    ),
}
# Each run's limit (seconds): a hung run must not take the rest of the call with it.
TIMEOUT_S = {"capture_drain": 120, "capture_host": 90, "capture_load": 150}


def tree_env(tree: Path) -> dict[str, str]:
    """The environment with ``tree`` first on ``PYTHONPATH`` (wheels carried to the
    device machine stay importable behind it)."""
    rest = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(tree) + (os.pathsep + rest if rest else "")}


@functools.cache
def launch_dir() -> Path:
    """Where the runs start: a folder that holds only a link to this ``bench/``. ``-m``
    and ``-c`` put the working directory first on sys.path, so ``bench`` is this one
    and ``syncless`` the tree's on PYTHONPATH (a repository root would give its own)."""
    folder = Path(tempfile.mkdtemp(prefix="bench-before-after-"))
    (folder / "bench").symlink_to(BENCH, target_is_directory=True)
    atexit.register(shutil.rmtree, folder, True)  # the link, not what it points to
    return folder


def which_syncless(tree: Path, python: str) -> str:
    """Where ``import syncless`` finds the package with ``PYTHONPATH=tree``."""
    env = tree_env(tree)
    code = "import syncless, os; print(os.path.dirname(os.path.abspath(syncless.__file__)))"
    # From where the benchmarks run (launch_dir).
    out = subprocess.run(
        [python, "-c", code], env=env, capture_output=True, text=True, cwd=launch_dir()
    )
    if out.returncode:
        raise SystemExit(f"cannot import syncless from {tree}: {out.stderr.strip()}")
    return out.stdout.strip()


def run_one(name: str, tree: Path, args: list[str], log: Path, python: str) -> str:
    env = tree_env(tree)
    cmd = [python, "-m", "bench.capture", name.removeprefix("capture_"), *args]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S[name], cwd=launch_dir()
        )
        text = done.stdout + done.stderr + f"\n[exit {done.returncode}]"
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += f"\n[timed out after {TIMEOUT_S[name]} s]"
    took = time.perf_counter() - start
    log.write_text(f"$ PYTHONPATH={tree} {' '.join(cmd)}\n{text}\n[{took:.1f} s]\n")
    return text


# -- the numbers each benchmark prints ---------------------------------------------------


def numbers(name: str, text: str) -> dict[str, float]:
    """The key numbers of one run's output (empty where it failed)."""
    out: dict[str, float] = {}
    if name == "capture_drain":
        m = re.search(r"([\d.]+) GB/s wall = (\d+)% of pinned D2H ([\d.]+) GB/s", text)
        if m:
            out["drain wall GB/s"] = float(m[1])
            out["drain % of pinned D2H"] = float(m[2])
        m = re.search(r"capture\(\) host ([\d.]+) us/call", text)
        if m:
            out["drain bench: capture() host us"] = float(m[1])
    elif name == "capture_host":
        for m in re.finditer(r"^(\w[\w ,]*?)\s+median\s+([\d.]+) mean\s+([\d.]+) us", text, re.M):
            out[f"host us median, {m[1].strip()}"] = float(m[2])
            out[f"host us mean, {m[1].strip()}"] = float(m[3])
    elif name == "capture_load":
        for m in re.finditer(r"; (\w[\w-]*): step ([+-][\d.]+)% \[", text):
            out[f"load {m[1]}: step overhead %"] = float(m[2])
        pattern = r"; (\w[\w-]*): step .*?large median ([\d.]+)(?:.*?small median ([\d.]+))?"
        for m in re.finditer(pattern, text):
            out[f"load {m[1]}: capture() large us"] = float(m[2])
            if m[3]:
                out[f"load {m[1]}: capture() small us"] = float(m[3])
    return out


def result_lines(name: str, text: str) -> list[str]:
    """The lines a benchmark would have appended to RESULTS.md."""
    if name == "capture_drain":
        return [line for line in text.splitlines() if line.startswith("unconstrained drain")]
    if name == "capture_host":
        rows = re.findall(r"^(\w[\w ,]*?)\s+median\s+([\d.]+) mean\s+([\d.]+) us", text, re.M)
        if not rows:
            return []
        body = "; ".join(f"{k.strip()} {float(a):.2f} / {float(b):.2f}" for k, a, b in rows)
        return [f"capture() host us, median / mean (4 KiB): {body}"]
    return [line for line in text.splitlines() if re.search(r"; \w[\w-]*: step [+-]", line)]


def device_line(python: str, tree: Path) -> str:
    code = (
        "import torch, os; n = torch.cuda.device_count(); "
        "print((f'{n}x ' + torch.cuda.get_device_name()) if n else "
        "f'CPU ({os.cpu_count()} cores)', '|', 'torch', torch.__version__)"
    )
    env = tree_env(tree)
    out = subprocess.run(
        [python, "-c", code], env=env, capture_output=True, text=True, cwd=launch_dir()
    )
    return out.stdout.strip() or "unknown device"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test, small sizes")
    parser.add_argument(
        "--benchmarks", default=",".join(ARGS), help="comma list (default: all three)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=560.0,
        help="skip a run that could end past this many seconds (default fits a 600 s call)",
    )
    args = parser.parse_args(argv)
    try:
        trees = {"before": Path(os.environ["BEFORE"]), "after": Path(os.environ["AFTER"])}
        out_dir = Path(os.environ["OUT"])
    except KeyError as e:
        raise SystemExit(f"set {e.args[0]}: BEFORE=dir AFTER=dir OUT=dir (see --help)") from None
    python = os.environ.get("PYTHON", sys.executable)
    trees = {k: v.resolve() for k, v in trees.items()}
    for label, tree in trees.items():
        found = which_syncless(tree, python)
        if Path(found) != tree / "syncless":
            raise SystemExit(f"{label}: syncless imports from {found}, not {tree}/syncless")
    labels = {k: os.environ.get(f"{k.upper()}_LABEL", k) for k in trees}
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget_s
    texts: dict[str, dict[str, list[str]]] = {}
    for name in args.benchmarks.split(","):
        bench_args = ARGS[name][1 if args.tiny else 0]
        texts[name] = {"before": [], "after": []}
        for n, which in enumerate(ORDER):
            if time.perf_counter() + TIMEOUT_S[name] > deadline:
                print(f"{name} {n} {which}: skipped (it could end past --budget-s)", flush=True)
                continue
            log = out_dir / f"{name}-{n}-{which}.log"
            text = run_one(name, trees[which], bench_args, log, python)
            texts[name][which].append(text)
            print(f"{name} {n} {which}: {numbers(name, text)}", flush=True)

    today = datetime.date.today().isoformat()
    device = device_line(python, trees["after"])
    report = [
        f"# capture benchmarks, before ({labels['before']}) and after ({labels['after']})",
        "",
        f"{today}, {device}; order per benchmark {', '.join(ORDER)}; medians over the runs.",
        "",
        "| number | before | after | runs before / after |",
        "|---|---|---|---|",
    ]
    for name, runs in texts.items():
        per = {w: [numbers(name, t) for t in runs[w]] for w in runs}
        keys = list(dict.fromkeys(k for w in per for r in per[w] for k in r))
        for key in keys:
            cells = []
            for which in ("before", "after"):
                values = [r[key] for r in per[which] if key in r]
                cells.append(
                    f"{statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})"
                    if values
                    else "n/a"
                )
            counts = " / ".join(str(sum(key in r for r in per[w])) for w in ("before", "after"))
            report.append(f"| {key} | {cells[0]} | {cells[1]} | {counts} |")
    report += ["", "Lines for bench/RESULTS.md (one per run):", "", "```"]
    for name, runs in texts.items():
        for which in ("before", "after"):
            for i, text in enumerate(runs[which]):
                for line in result_lines(name, text):
                    head = f"- {today} | {device} | {labels[which]} ({which}, run {i + 1})"
                    report.append(f"{head} | {name} | {line}")
    report.append("```")
    (out_dir / "before_after.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))
