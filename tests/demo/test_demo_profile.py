import subprocess
import sys

import pytest

from syncless.cli import main
from syncless.run import open as open_run


def _values(run_dir, like):
    with open_run(run_dir) as store:
        _, rows = store.query(
            f"SELECT name, step, value FROM metrics WHERE name LIKE '{like}' ORDER BY name, step"
        )
    return rows


def test_demo_profile_sections_and_exact_calls(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["demo", "--steps", "8", "--n-layers", "3", "--profile", "events",
            "--profile-every", "4", "--run-dir", str(run_dir)]  # fmt: skip
    assert main(argv) == 0
    assert "profile: 4 step(s)" in capsys.readouterr().err
    calls = {(n, s): v for n, s, v in _values(run_dir, "profile/%/calls_count")}
    # Ground truth from the demo's structure: one attention, router and experts module
    # per layer, one forward per step.
    for step in (3, 7):
        assert calls[("profile/attention/calls_count", step)] == 3
        assert calls[("profile/router/calls_count", step)] == 3
        assert calls[("profile/experts/calls_count", step)] == 3
        assert calls[("profile/forward/calls_count", step)] == 1
        assert calls[("profile/optimizer/calls_count", step)] == 1
    times = {(n, s): v for n, s, v in _values(run_dir, "profile/%/time_ms")}
    for step in (3, 7):
        parts = sum(times[(f"profile/{p}/time_ms", step)] for p in
                    ("data", "forward", "backward", "grad_sync", "optimizer", "log"))  # fmt: skip
        # the top-level phases cover the step but for the loop's own bookkeeping
        assert 0.8 * times[("profile/step/time_ms", step)] <= parts
        assert parts <= times[("profile/step/time_ms", step)] * 1.001


@pytest.mark.dist
def test_demo_profile_splits_expert_parallel_collectives(tmp_path):
    run_dir = tmp_path / "ep"
    proc = subprocess.run(
        [sys.executable, "-m", "syncless.cli", "demo", "--nproc", "2", "--expert-parallel",
         "--batch-size", "4", "--steps", "4", "--n-layers", "2", "--profile", "events",
         "--profile-every", "4", "--run-dir", str(run_dir), "--quiet"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = {n: v for n, s, v in _values(run_dir, "profile/moe_%/calls_count") if s == 3}
    # per step: 2 layers x (counts exchange, dispatch, combine) forward, and the
    # dispatch and combine backward
    for name in ("moe_counts", "moe_dispatch", "moe_combine", "moe_dispatch_bwd",
                 "moe_combine_bwd"):  # fmt: skip
        assert calls[f"profile/{name}/calls_count"] == 2
    names = {n for n, _, _ in _values(run_dir, "profile/moe_dispatch/%")}
    assert {"profile/moe_dispatch/rendezvous_ms", "profile/moe_dispatch/transfer_ms",
            "profile/moe_dispatch/enqueue_ms"} <= names  # fmt: skip


def test_bad_profile_mode(capsys):
    assert main(["demo", "--profile", "fast"]) == 2
    assert "expected one of off, events, collectives, sync" in capsys.readouterr().err
