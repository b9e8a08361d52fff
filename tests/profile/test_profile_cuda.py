"""CUDA paths: event pool reuse, lagged read-back, sync/collectives modes (needs a GPU)."""

import pytest
import torch

from syncless.guard import no_sync
from syncless.profile import Profiler
from syncless.profile.timers import EventTimer, SyncTimer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _steps(prof, n, x):
    for s in range(n):
        with prof.step(s):
            with prof.section("mm"):
                y = x @ x
            with prof.section("copy", "bandwidth", bytes=x.numel() * x.element_size() * 2):
                z = y.clone()
            prof.collective("fake", torch.add, z, 1.0)


def test_events_mode_pool_stops_growing_and_never_syncs_in_the_step():
    prof = Profiler(mode="events", report_every=100)
    assert isinstance(prof._timer, EventTimer)
    x = torch.randn(256, 256, device="cuda")
    _steps(prof, 2, x)  # warm-up: both pools filled
    size = prof._timer.pool_size
    with no_sync():  # CUDA: also torch's sync debug mode
        _steps(prof, 5, x)
    assert prof._timer.pool_size == size
    rep = prof.report(force=True)
    assert rep.row("mm").calls_per_step == 1.0
    assert rep.row("mm").ms_per_step > 0.0
    assert rep.row("copy").gb_per_s is not None
    assert rep.row("fake/transfer").calls_per_step == 1.0


@pytest.mark.parametrize("mode", ["collectives", "sync"])
def test_other_modes_report_the_same_rows(mode):
    prof = Profiler(mode=mode, report_every=3)
    assert isinstance(prof._timer, SyncTimer) == (mode == "sync")
    x = torch.randn(128, 128, device="cuda")
    _steps(prof, 3, x)
    rep = prof.report()
    names = {r.name for r in rep.rows}
    assert {"step", "mm", "copy", "fake", "fake/enqueue", "fake/transfer"} <= names
    assert rep.values["profile/step/time_ms"] > 0.0


def test_calibration_measures_event_and_synchronize():
    prof = Profiler()
    cal = prof.calibrate()
    assert cal.event_record_us is not None and cal.event_record_us > 0
    assert cal.synchronize_us is not None and cal.synchronize_us > 0


def test_a_section_ends_on_the_stream_it_started_on():
    """Closed while a side stream is current, a section still times its own stream's work
    (recorded on the idle side stream, its end would mark ~nothing)."""
    prof = Profiler(mode="events", report_every=100, calibrate=False)
    side = torch.cuda.Stream()
    before, after = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    with no_sync():
        for step in range(3):  # the first two fill the pools: their ends take _grow
            with prof.step(step):
                prof.begin_section("slow")
                before.record()
                torch.cuda._sleep(20_000_000)  # ~10 ms on the default stream
                after.record()
                with torch.cuda.stream(side):
                    prof.end_section("slow")
    torch.cuda.synchronize()
    sleep_ms = before.elapsed_time(after)  # the last step's, from torch's own events
    rep = prof.report(force=True)
    assert rep.row("slow").calls_per_step == 1.0
    assert rep.row("slow").ms_per_step >= 0.9 * sleep_ms
