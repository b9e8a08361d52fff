"""``syncless demo --nproc N``: the same demo under torchrun, on this machine.

The launcher runs torchrun through this module (``python -m syncless.demo.launch
LAUNCHER_PID TORCHRUN_ARGS...``), which asks for SIGTERM when the launcher dies
before handing over to torchrun. How the three levels stop together:
:mod:`syncless.demo.signals`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from syncless.demo.signals import AGENT_PID_ENV, descendants, die_with_parent

#: The signals the launcher passes on to torchrun (SIGHUP as SIGTERM).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def launch(nproc: int, demo_argv: Sequence[str]) -> int:
    """Run ``syncless demo <demo_argv>`` on ``nproc`` local ranks; return the exit code.

    torchrun (torch.distributed.run) rather than a hand-rolled spawn: it is what users
    run in production, it sets RANK/WORLD_SIZE/LOCAL_RANK and tears every rank down
    when one fails. A signal to the launcher stops every rank (see module).
    """
    torchrun_args = [
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        # Port 0: the agent's store binds a free port itself and holds it from then on.
        # A port picked here and closed again stayed free only until another process
        # took it, as the client end of any connection may, during the seconds torchrun
        # takes to start: the agent then failed to bind, and the launch with it (seen
        # once in a full test run on a loaded machine, tests/demo/test_stop.py).
        "--rdzv-endpoint=127.0.0.1:0",
        "--rdzv-backend=c10d",
        "-m",
        "syncless.cli",
        "demo",
        *demo_argv,
    ]
    cmd = [sys.executable, "-m", "syncless.demo.launch", str(os.getpid()), *torchrun_args]
    # A session of its own: a terminal's Ctrl-C reaches the launcher only, which passes
    # it on once (torchrun stops its ranks on the first signal, not on two).
    with subprocess.Popen(cmd, start_new_session=True) as torchrun:
        return _supervise(torchrun)


def _supervise(torchrun: subprocess.Popen) -> int:
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        if len(received) == 1:  # every rank flushes and exits (a rank's SIGHUP would not)
            torchrun.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)
        else:  # asked twice: now
            for pid in [torchrun.pid, *descendants(torchrun.pid)]:
                _kill(pid, signal.SIGKILL)

    # A signal ignored on the way in stays ignored (nohup's SIGHUP, say).
    watched = [s for s in FORWARDED if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, forward) for s in watched}
    try:
        code = torchrun.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        return 128 + received[0]
    return 128 - code if code < 0 else code  # torchrun killed by a signal: as a shell says


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # ended meanwhile
        os.kill(pid, sig)


def _run_torchrun(launcher_pid: int, torchrun_args: list[str]) -> None:
    """torchrun's agent, stopped (SIGTERM) when the launcher dies, even by SIGKILL."""
    die_with_parent(signal.SIGTERM, parent=launcher_pid)
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the ranks' parent, for their own guard
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    try:
        main(torchrun_args)
    except SignalException as e:  # stopped as asked: the ranks are gone, no traceback
        sys.exit(128 + e.sigval)


if __name__ == "__main__":
    _run_torchrun(int(sys.argv[1]), sys.argv[2:])
