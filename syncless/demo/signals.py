"""How the processes of ``syncless demo --nproc N`` stop together.

Three processes deep: the launcher (``syncless demo``), torchrun's agent, the ranks.
torchrun starts every rank in a session of its own, so a terminal's Ctrl-C reaches
only the launcher (it starts torchrun in a new session too) and stopping is passed
down, never broadcast:

- The launcher forwards SIGINT, SIGTERM and SIGHUP (as SIGTERM, which a rank handles)
  to torchrun, once; torchrun sends it to every rank and SIGKILLs what is left after
  30 s. A signal ignored on the way in (nohup's SIGHUP) stays ignored. A second signal
  to the launcher SIGKILLs torchrun and every rank at once.
- A rank notes its first SIGINT or SIGTERM, and at the next logged step every rank
  learns of it through that step's stats all_reduce and raises :class:`Stopped`, so
  all ranks leave the loop after the same step: the ``finally`` blocks close the tools
  and flush the run's shards, and the rank exits with ``128 + signal``. (One process
  raises at once.) Later signals are ignored, so the flush is not cut short;
  a watchdog ends the rank ``GRACE_S`` after the first one if the flush hangs.
- SIGKILL cannot be caught, so each child asks the kernel for a signal when its parent
  dies (Linux ``prctl(PR_SET_PDEATHSIG)``): torchrun gets SIGTERM when the launcher
  dies, a rank SIGTERM when torchrun dies, and both take the graceful path above.
  Chosen over polling ``os.getppid()``: no thread, no delay, nothing to tune. The
  catch is that it fires when the parent *thread* that forked the child exits; the
  launcher and torchrun both start their children from the main thread. Elsewhere
  than Linux it is a no-op: a SIGKILLed launcher leaves the job running there.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator

#: Seconds a stopping rank has to flush before the watchdog ends it (torchrun's own
#: SIGKILL comes at 30 s).
GRACE_S = 20.0
#: The environment variable that tells a rank its parent's pid (set by the launcher's
#: torchrun for its ranks).
AGENT_PID_ENV = "SYNCLESS_AGENT_PID"
PR_SET_PDEATHSIG = 1


class Stopped(BaseException):
    """Raised in the main thread by the first stop signal (a BaseException, like
    KeyboardInterrupt, so ``except Exception`` does not swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.run_dir: object = None  # the demo's run directory, where it knows it

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies.

    ``parent``: the pid the parent should have; without it, the parent at call time.
    If it has already died (before the request could take effect), this process gets
    ``sig`` now. Returns False where the request is not available (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    expected = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != expected:  # the parent died before the request was in place
        os.kill(os.getpid(), sig)
    return True


_pending = 0  # a deferred stop signal's number, 0 while none came


def pending_stop() -> int:
    """The stop signal :func:`stop_on` deferred (``deferred=True``), or 0."""
    return _pending


@contextlib.contextmanager
def stop_on(
    signals: Iterable[int], grace_s: float | None = GRACE_S, deferred: bool = False
) -> Iterator[None]:
    """Inside: the first of ``signals`` raises :class:`Stopped` in the main thread.

    Later ones are ignored. ``grace_s``: then end the process after that many
    seconds, flushed or not (None: never). The previous handlers come back on exit;
    off the main thread (where Python allows no handler) it does nothing.

    ``deferred``: only note the signal (:func:`pending_stop`); the training loop stops
    at a step the ranks agree on. Raised at once, a rank stopped between collectives
    while another sat blocked in one that it would never join (a Python handler cannot
    run inside a blocking C call): that rank waited for torchrun's SIGKILL at 30 s,
    its records unflushed (1 of 7 CI runs of tests/demo/test_stop.py).
    """
    global _pending
    watched = list(signals)
    _pending = 0

    def handler(signum: int, _frame: object) -> None:
        global _pending
        for s in watched:
            signal.signal(s, signal.SIG_IGN)
        if grace_s is not None:
            threading.Thread(target=_exit_after, args=(grace_s, 128 + signum), daemon=True).start()
        if deferred:
            _pending = signum
            return
        raise Stopped(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in watched}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _exit_after(seconds: float, code: int) -> None:
    time.sleep(seconds)
    print(f"syncless: still stopping after {seconds:.0f} s: exiting now", file=sys.stderr)
    os._exit(code)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, from ``/proc`` (empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
