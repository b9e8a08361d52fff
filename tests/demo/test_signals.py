"""``stop_on``: a stop signal raises at once, or (ranks) waits for an agreed step."""

import os
import signal

import pytest

from syncless.demo.signals import Stopped, pending_stop, stop_on


def test_a_signal_raises_stopped_at_once_by_default():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as caught, stop_on([signal.SIGTERM], grace_s=None):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs at the next bytecode boundary
            pass
    assert caught.value.exit_code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back


def test_deferred_only_notes_the_signal_for_the_loop_and_ignores_later_ones():
    with stop_on([signal.SIGTERM, signal.SIGINT], grace_s=None, deferred=True):
        assert pending_stop() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass
        assert pending_stop() == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # ignored: no KeyboardInterrupt, no change
        for _ in range(1000):
            pass
        assert pending_stop() == signal.SIGTERM
    with stop_on([signal.SIGTERM], grace_s=None, deferred=True):
        assert pending_stop() == 0  # a new stop_on starts clean
