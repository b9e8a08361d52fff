"""``syncless demo --nproc N`` names no port of its own to torchrun.

The launcher used to pick a free port (bind port 0, read it, close it) and pass it to
torchrun. The port stayed free only until another process took it, as the client end
of any connection may, during the seconds torchrun takes to start; then the agent's
store failed to bind and the launch failed. A full test run on a loaded 2-core machine
met it once (tests/demo/test_stop.py). Port 0 lets the store bind a free port itself
and hold it from then on; the ranks learn it from the rendezvous.
"""

from __future__ import annotations

import socket

import pytest

from syncless.demo import launch


class _Torchrun:
    """What ``launch`` needs of the torchrun process: a context manager that waits."""

    def __init__(self, cmd: list[str], **_kwargs) -> None:
        self.cmd = cmd
        self.pid = 0

    def __enter__(self) -> _Torchrun:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def wait(self) -> int:
        return 0


def test_the_launcher_hands_torchrun_port_0_and_binds_nothing(monkeypatch):
    started: list[_Torchrun] = []

    def popen(cmd, **kwargs):
        started.append(_Torchrun(cmd, **kwargs))
        return started[-1]

    def no_bind(*_args):
        raise AssertionError("the launcher must not pick a port itself")

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    monkeypatch.setattr(socket.socket, "bind", no_bind)
    assert launch.launch(2, ["--steps", "3"]) == 0
    (torchrun,) = started
    assert "--rdzv-endpoint=127.0.0.1:0" in torchrun.cmd
    assert not [a for a in torchrun.cmd if a.startswith("--master-port")]


@pytest.mark.parametrize("argv", [["--nproc", "2"], ["--nproc=2", "--steps", "3"]])
def test_strip_nproc_removes_the_flag_in_both_spellings(argv):
    assert "--nproc" not in " ".join(launch.strip_nproc(argv))
