"""A run killed with SIGKILL leaves every completed shard readable."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from syncless.run import open as open_run

METRICS_PER_STEP = 4

WRITER = textwrap.dedent(
    """
    import sys, time
    from syncless.run import Run
    run = Run(run_dir=sys.argv[1], flush_interval_s=0.05)
    step = 0
    while True:
        run.log(step, {f"test/step/m{i}": step * 10 + i for i in range(METRICS)})
        step += 1
        time.sleep(0.002)
    """
).replace("METRICS", str(METRICS_PER_STEP))


def test_sigkill_leaves_a_queryable_store(tmp_path):
    run_dir = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run_dir)])
    try:
        deadline = time.monotonic() + 60
        while len(list((run_dir / "metrics").glob("*.parquet"))) < 5:
            assert proc.poll() is None, "writer exited early"
            assert time.monotonic() < deadline, "no shards appeared"
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    with open_run(run_dir) as store:
        _, rows = store.query("SELECT step, name, value FROM metrics ORDER BY step, name")
    assert rows, "flushed steps must be readable"
    steps = sorted({s for s, _, _ in rows})
    # Records are enqueued in step order and shards are whole, so what survives is
    # exactly a prefix of steps, each with all of its metrics and their exact values.
    assert steps == list(range(len(steps)))
    expected = [
        (s, f"test/step/m{i}", float(s * 10 + i)) for s in steps for i in range(METRICS_PER_STEP)
    ]
    assert rows == expected
