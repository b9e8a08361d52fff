"""Progress in a log: plain lines while the demo runs, not one burst when it ends."""

import io
import os
import signal
import subprocess
import sys
import time

from rich.console import Console

from syncless.demo import progress
from syncless.demo.progress import LiveView, ProgressLines, progress_view
from syncless.run import StepRecord
from syncless.run import open as open_run


def _step(step, loss=2.0):
    return [
        StepRecord("r", step, 0, "demo/step/loss", loss, 0.0),
        StepRecord("r", step, 0, "demo/step/tokens_per_s", 1000.0, 0.0),
    ]


def test_a_file_gets_lines_a_terminal_the_live_view():
    file_console = Console(file=io.StringIO())
    assert isinstance(progress_view(10, "t", file_console), ProgressLines)
    terminal = Console(file=io.StringIO(), force_terminal=True)
    view = progress_view(10, "t", terminal)
    assert isinstance(view, LiveView)
    view.close()


def test_lines_come_at_the_first_step_every_few_seconds_and_at_the_last(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    lines = ProgressLines(10, "demo", Console(file=out), first_step=20, every_s=5.0)
    for step in range(20, 30):
        lines.write(_step(step, loss=float(step)))
        now[0] += 1.0  # a second a step
    lines.close()
    printed = out.getvalue().splitlines()
    assert [line.split("  ")[0] for line in printed] == [
        "demo: step 20 (1/10)",  # the first logged step
        "demo: step 25 (6/10)",  # 5 s later
        "demo: step 29 (10/10)",  # the last
    ]
    assert "loss 25.0000" in printed[1] and "tokens/s 1,000" in printed[1]


def test_the_demo_prints_progress_to_a_pipe_while_it_runs(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncless.cli", "demo", "--steps", "1000000",
         "--flush-interval-s", "3600", "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # The first line comes after step 0, flushed, while the demo is still running
        # (a library's warning may come before it).
        seen = []
        for line in iter(proc.stderr.readline, ""):
            seen.append(line)
            if "step 0 (" in line:
                break
        assert "syncless demo (cpu, 1 rank(s)): step 0 (1/1000000)  loss " in seen[-1], seen
        assert proc.poll() is None
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)  # one process: SIGTERM stops it flushed too
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert time.monotonic() - start < 30
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "stopped by SIGTERM: logged steps are flushed" in rest
    with open_run(run_dir) as store:  # written at the stop, not by the periodic flush
        _, rows = store.query("SELECT count(*) FROM metrics WHERE name = 'demo/step/loss'")
    assert rows[0][0] >= 1
