"""HostLanding: issue now, read later; waits only for a copy still in flight."""

import pytest
import torch

from syncless.pacing import HostLanding


@pytest.mark.no_sync
def test_cpu_landing_reads_what_was_issued():
    landing = HostLanding()
    for values in ([3, 1, 2, 0], [0, 0, 6, 0]):
        landing.issue(torch.tensor(values))
        assert landing.read() == values
    assert landing.stats() == {"reads": 2, "waits": 0, "wait_s": 0.0, "max_wait_s": 0.0}


@pytest.mark.no_sync
def test_the_buffer_is_reused_and_the_issue_is_a_copy():
    landing = HostLanding()
    counts = torch.tensor([1, 2, 3])
    landing.issue(counts)
    counts.fill_(9)  # the landed values are a copy, taken at issue time
    assert landing.read() == [1, 2, 3]
    host = landing._host
    landing.issue(torch.tensor([4, 5, 6]))
    assert landing._host is host
    assert landing.read() == [4, 5, 6]


def test_a_read_waits_only_when_the_copy_is_still_in_flight(fake_device):
    landing = HostLanding(event_factory=fake_device.event, clock=fake_device.clock)
    landing.issue(torch.tensor([1, 2]))
    fake_device.catch_up()  # the copy landed while the host did other work
    assert landing.read() == [1, 2]
    assert landing.waits == 0
    landing.issue(torch.tensor([3, 4]))
    assert landing.read() == [3, 4]  # still in flight: the read waits for it
    assert (landing.waits, landing.wait_s) == (1, 1.0)
    assert landing.reads == 2


def test_one_copy_at_a_time():
    landing = HostLanding()
    with pytest.raises(RuntimeError, match="without issue"):
        landing.read()
    landing.issue(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="twice"):
        landing.issue(torch.tensor([1]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_landing_is_pinned_and_non_blocking():
    from syncless.guard import no_sync

    landing = HostLanding()
    counts = torch.arange(8, device="cuda")
    landing.issue(counts)  # allocates the pinned buffer (allowed once)
    landing.read()
    with no_sync():
        landing.issue(counts * 2)
        values = landing.read()
    assert landing._host.is_pinned()
    assert values == list(range(0, 16, 2))
