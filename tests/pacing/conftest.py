"""A device and a clock the test drives, for deterministic pacing tests on CPU."""

from __future__ import annotations

import pytest


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeDevice:
    """Runs recorded points in order; the test says how far it has got (``done``).

    ``synchronize`` on an event lets the device finish up to that event's point and
    advances the clock by ``point_s`` per point it had to run.
    """

    def __init__(self, clock: FakeClock, point_s: float = 1.0) -> None:
        self.clock = clock
        self.point_s = point_s
        self.recorded = 0  # events recorded so far (point i records event i)
        self.done = 0  # the device has finished points 0 .. done - 1
        self.events_created = 0

    def event(self) -> FakeEvent:
        self.events_created += 1
        return FakeEvent(self)

    def catch_up(self) -> None:
        """The device finishes everything recorded so far (it is ahead of the host)."""
        self.done = self.recorded

    @property
    def behind(self) -> int:
        """Points the host has recorded that the device has not finished."""
        return self.recorded - self.done


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.index = -1

    def record(self) -> None:
        self.index = self.device.recorded
        self.device.recorded += 1

    def query(self) -> bool:
        return self.device.done > self.index

    def synchronize(self) -> None:
        device = self.device
        if device.done <= self.index:
            device.clock.t += (self.index + 1 - device.done) * device.point_s
            device.done = self.index + 1


@pytest.fixture
def fake_device() -> FakeDevice:
    """A stalled fake device (the test moves it) with its own clock (``.clock``)."""
    return FakeDevice(FakeClock(), point_s=1.0)
