"""RunAheadLimiter, driven by a fake device and clock: bound, waits, counters."""

import pytest
import torch

from syncless.pacing import RunAheadLimiter


@pytest.fixture
def make(fake_device):
    def make(depth: int, point_s: float = 1.0):
        fake_device.point_s = point_s
        limiter = RunAheadLimiter(depth, event_factory=fake_device.event, clock=fake_device.clock)
        return limiter, fake_device

    return make


@pytest.mark.no_sync
@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_a_stalled_device_holds_the_host_to_depth_points_ahead(make, depth):
    limiter, device = make(depth, point_s=0.5)
    n = 12
    for _ in range(n):
        limiter.point()
        # After each point the host has recorded at most `depth` unfinished points.
        assert device.behind <= depth
    assert device.behind == depth
    # Ground truth: the device never moves by itself, so from point `depth` on every
    # point waits for exactly one more point of device work (0.5 s each).
    assert limiter.points == n
    assert limiter.waits == n - depth
    assert limiter.wait_s == pytest.approx((n - depth) * 0.5)
    assert limiter.max_wait_s == pytest.approx(0.5)
    assert limiter.unpaced_points == 0


@pytest.mark.no_sync
@pytest.mark.parametrize("depth", [1, 3])
def test_no_wait_when_the_host_is_behind(make, depth):
    limiter, device = make(depth)
    for _ in range(20):
        limiter.point()
        device.catch_up()  # the device finishes each point before the host's next one
    assert limiter.waits == 0
    assert limiter.wait_s == 0.0
    assert limiter.points == 20


def test_depth_zero_waits_for_the_current_point(make):
    limiter, device = make(0)
    for _ in range(5):
        limiter.point()
        assert device.behind == 0  # like a drain, without a read
    assert limiter.waits == 5


def test_waits_only_for_the_missing_part(make):
    limiter, device = make(depth=2, point_s=1.0)
    for _ in range(3):
        limiter.point()  # points 0, 1, 2: the third waits for point 0
    assert (limiter.waits, limiter.wait_s) == (1, 1.0)
    device.done = 3  # the device caught up with points 1 and 2 on its own
    limiter.point()  # point 3 needs point 1: done already
    limiter.point()  # point 4 needs point 2: done already
    assert (limiter.waits, limiter.wait_s) == (1, 1.0)
    limiter.point()  # point 5 needs point 3: one point of device work
    assert (limiter.waits, limiter.wait_s) == (2, 2.0)


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("lead", [1, 2, 3, 4])
def test_the_host_waits_exactly_when_its_lead_exceeds_depth(make, depth, lead):
    limiter, device = make(depth)
    n = 10
    for i in range(n):
        # The device has reached point i - lead when the host arrives at point i.
        device.done = max(device.done, i - lead + 1)
        limiter.point()
    # Points i >= depth find the device at i - lead: they wait iff lead > depth.
    assert limiter.waits == (n - depth if lead > depth else 0)


def test_events_are_reused(make):
    limiter, device = make(depth=3)
    for _ in range(50):
        limiter.point()
    assert device.events_created == 4  # depth + 1 in flight at most


def test_reset_forgets_in_flight_points(make):
    limiter, device = make(depth=1)
    limiter.point()
    limiter.reset()
    device.catch_up()
    limiter.point()
    assert limiter.waits == 0


@pytest.mark.no_sync
def test_without_cuda_events_the_limiter_only_counts():
    limiter = RunAheadLimiter(2, device="cpu")
    assert not limiter.paced
    for _ in range(7):
        limiter.point()
    assert limiter.stats() == {
        "points": 7,
        "unpaced_points": 7,
        "waits": 0,
        "wait_s": 0.0,
        "max_wait_s": 0.0,
    }


def test_negative_depth_is_rejected():
    with pytest.raises(ValueError, match="depth must be >= 0"):
        RunAheadLimiter(-1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bounds_real_run_ahead():
    limiter = RunAheadLimiter(1, device="cuda")
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        limiter.point()
        for _ in range(4):
            x = (x @ x).clamp_(-1, 1)  # enough device work for the host to get ahead
    assert limiter.paced and limiter.points == 8
    assert limiter.waits > 0 and limiter.wait_s > 0
