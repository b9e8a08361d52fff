"""Straggler scores and verdicts from hand-built summaries, and the NVML sampler with a
stand-in NVML (known answers: the slowdowns and clocks put in)."""

import logging
import sys
import time
import types

import numpy as np
import pytest

from syncless.profile import RankSummary, SectionTotals
from syncless.profile import gpu_sensors as gs
from syncless.profile.report import straggler_values
from syncless.profile.stragglers import StragglerConfig, StragglerDetector, fleet

STEPS = 10
BASE_MS = {"data": 2.0, "forward": 10.0, "experts": 6.0, "backward": 20.0, "grad_sync": 5.0}
PARENT = {"experts": "forward"}
CATEGORY = {"grad_sync": "collective"}


def _summary(rank, ms, sensors=None):
    """One rank's report window: ``ms`` section -> ms per step; the step is their sum."""
    secs = {}
    for name, per_step in ms.items():
        secs[name] = SectionTotals(name, CATEGORY.get(name, "compute"), "section",
                                   PARENT.get(name), per_step * 1e6 * STEPS, STEPS)  # fmt: skip
    top = sum(v for k, v in ms.items() if k not in PARENT)
    return RankSummary(rank, STEPS, top * 1e6 * STEPS, 0.0, 0, secs, sensors=sensors)


def _report(world, slow=None, rng=None, sensors=None):
    """Every rank at BASE_MS (with 1% noise if ``rng``); ``slow``: rank -> {section: extra ms}."""
    out = []
    for r in range(world):
        ms = {k: v * (1 + 0.01 * rng.standard_normal()) if rng else v for k, v in BASE_MS.items()}
        for name, extra in (slow or {}).get(r, {}).items():
            ms[name] += extra
            if name in PARENT:
                ms[PARENT[name]] += extra  # a child's time is inside its parent's
        out.append(_summary(r, ms, None if sensors is None else sensors[r]))
    return out


def _run(detector, reports):
    """Feed reports of STEPS steps each; the verdicts after each."""
    return [detector.update(fleet(rep), i * STEPS, i * STEPS + STEPS - 1)
            for i, rep in enumerate(reports)]  # fmt: skip


def test_a_rank_twice_as_slow_is_named_when_the_window_mean_crosses_the_threshold():
    # Window of 5 reports: after k slow reports of 2x, own = base * (1 + k/5), so the
    # score is 1 / (1 + k/5): 0.83 after one (not named), 0.71 after two (named).
    rng = np.random.default_rng(0)
    healthy = [_report(16, rng=rng) for _ in range(6)]
    slow = [_report(16, {5: {"backward": BASE_MS["backward"]}}, rng) for _ in range(4)]
    seen = []
    detector = StragglerDetector(on_straggler=seen.append)
    after = _run(detector, healthy + slow)
    assert all(v == [] for v in after[:7])
    (verdict,) = after[7]
    assert (verdict.rank, verdict.section) == (5, "backward")
    assert verdict.first_step == 6 * STEPS  # the first slow report's first step
    assert verdict.last_step == 8 * STEPS - 1
    assert verdict.score == pytest.approx(1 / 1.4, rel=0.03)
    (last,) = after[9]
    assert last.first_step == 6 * STEPS and last.last_step == 10 * STEPS - 1
    assert last.score == pytest.approx(1 / 1.8, rel=0.03)
    assert seen == [verdict]  # called once, when it opened


def test_a_ten_times_slower_rank_is_named_at_its_first_slow_report():
    detector = StragglerDetector()
    after = _run(detector, [_report(8)] * 3 + [_report(8, {2: {"data": 9 * BASE_MS["data"]}})])
    (verdict,) = after[3]
    assert (verdict.rank, verdict.section, verdict.first_step) == (2, "data", 3 * STEPS)
    # Window: the warm-up report left out, 2 healthy reports and one at 10x: own =
    # 2 * (2 + 10) / 3 = 8 ms.
    assert verdict.score == pytest.approx(2.0 / 8.0)


def test_the_warm_up_report_names_nobody_but_dates_a_rank_slow_from_the_start():
    # Rank 1 is slow from step 0; rank 2 only in the first report (one-time costs).
    first = _report(4, {1: {"data": 20.0}, 2: {"backward": 60.0}})
    after = _run(StragglerDetector(), [first, _report(4, {1: {"data": 20.0}})])
    assert after[0] == []
    (verdict,) = after[1]
    assert (verdict.rank, verdict.section, verdict.first_step) == (1, "data", 0)


def test_a_slow_child_is_named_instead_of_its_parent():
    detector = StragglerDetector()
    after = _run(detector, [_report(4, {1: {"experts": 12.0}})] * 2)
    assert {(v.rank, v.section) for v in after[-1]} == {(1, "experts")}


def test_waiting_sections_are_never_scored():
    # Three ranks wait 20 ms in grad_sync (a collective section) for rank 3, whose
    # backward is 20 ms slower: only rank 3 is named, in backward.
    waits = {r: {"grad_sync": 20.0} for r in range(3)} | {3: {"backward": 20.0}}
    detector = StragglerDetector()
    after = _run(detector, [_report(4, waits)] * 3)
    assert {(v.rank, v.section) for v in after[-1]} == {(3, "backward")}
    assert "grad_sync" not in detector.sections


def test_a_small_section_twice_as_slow_is_below_the_floor():
    # data is 2 ms of a 37 ms step: 2 ms more is 5.4% of the step; a 10% floor hides it.
    hide = StragglerConfig(min_excess_frac=0.10, window=1, warmup_reports=0)
    assert _run(StragglerDetector(hide), [_report(4, {0: {"data": 2.0}})]) == [[]]
    show = StragglerConfig(window=1, warmup_reports=0)
    assert _run(StragglerDetector(show), [_report(4, {0: {"data": 2.0}})])[0]


def test_a_verdict_closes_after_recovery_and_a_new_one_starts_afresh():
    detector = StragglerDetector(StragglerConfig(window=1, warmup_reports=0))
    slow, ok = _report(4, {2: {"forward": 30.0}}), _report(4)
    after = _run(detector, [slow, ok, ok, slow])
    assert [(v.first_step, v.last_step) for v in after[0]] == [(0, STEPS - 1)]
    assert after[1] == [] and after[2] == []
    assert [(v.first_step, v.last_step) for v in after[3]] == [(3 * STEPS, 4 * STEPS - 1)]


def test_a_rank_whose_clock_dropped_is_named_with_its_clock():
    clocks = [{"sm_clock_mhz": 1980.0, "sm_clock_min_mhz": 1980.0} for _ in range(8)]
    clocks[6] = {"sm_clock_mhz": 1700.0, "sm_clock_min_mhz": 1200.0}
    clocks[3] = {"sm_clock_mhz": 1900.0, "sm_clock_min_mhz": 1800.0}  # 0.91: not named
    detector = StragglerDetector()
    (verdict,) = _run(detector, [_report(8, sensors=clocks)])[0]
    assert (verdict.rank, verdict.section, verdict.clock_mhz) == (6, "gpu_clock", 1200.0)
    assert verdict.score == pytest.approx(1200.0 / 1980.0)
    assert "1200 MHz" in verdict.describe()


def test_records_hold_each_ranks_scores_and_the_lead_ranks_worst_per_section():
    detector = StragglerDetector(StragglerConfig(window=1, warmup_reports=0))
    verdicts = detector.update(fleet(_report(4, {2: {"backward": 20.0}})), 0, 9)
    mine = straggler_values(detector, verdicts, 2, lead=False)
    assert mine["profile/backward/straggler_score"] == pytest.approx(20.0 / 40.0)
    assert mine["profile/data/straggler_score"] == pytest.approx(1.0)
    assert mine["profile/backward/straggler_verdict_first_step"] == 0.0
    assert mine["profile/backward/straggler_verdict_last_step"] == 9.0
    assert mine["profile/backward/straggler_verdict_score"] == pytest.approx(0.5)
    assert "profile/grad_sync/straggler_score" not in mine
    lead = straggler_values(detector, verdicts, 0, lead=True)
    assert "profile/backward/straggler_verdict_first_step" not in lead
    assert lead["profile/backward/straggler_rank"] == 2.0
    assert lead["profile/backward/straggler_rank_score"] == pytest.approx(0.5)


# -- GPU sensors -----------------------------------------------------------------------


def _fake_nvml(clocks):
    """A stand-in for pynvml that reads ``clocks`` in turn."""
    readings = iter(clocks)
    nvml = types.SimpleNamespace(NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0)
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    nvml.nvmlDeviceGetHandleByUUID = lambda u: f"uuid:{u}"
    nvml.nvmlDeviceGetClockInfo = lambda h, kind: next(readings)
    nvml.nvmlDeviceGetPowerUsage = lambda h: 350_000  # mW
    nvml.nvmlDeviceGetTemperature = lambda h, kind: 71
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=90)
    return nvml


def test_sensor_summary_of_the_samples_since_the_last_one():
    sensors = gs.GpuSensors(_fake_nvml([1980, 1500, 1900, 1700]), "gpu0", interval_s=60)
    for _ in range(3):
        sensors.sample()
    got = sensors.summary()
    assert got["sm_clock_min_mhz"] == 1500.0 and got["sm_clock_mhz"] == 1900.0
    assert got["power_mean_w"] == 350.0 and got["temperature_max_c"] == 71.0
    assert got["util_mean_frac"] == pytest.approx(0.9) and got["samples_count"] == 3.0
    sensors.sample()
    assert sensors.summary()["sm_clock_min_mhz"] == 1700.0  # drained: only the new one
    assert sensors.summary() is None


def test_the_sampler_thread_samples_and_stops():
    nvml = _fake_nvml(iter(lambda: 1980, None))
    sensors = gs.GpuSensors.start(0, interval_s=0.01, nvml=nvml)
    try:
        deadline = time.monotonic() + 10
        while len(sensors._ring) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sensors.summary()["samples_count"] >= 3  # one at start, then the thread's
    finally:
        sensors.close()
    assert not sensors._thread.is_alive()


def test_without_nvml_one_warning_and_no_sensors(monkeypatch, caplog):
    monkeypatch.setattr(gs, "_warned", False)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with caplog.at_level(logging.WARNING, logger=gs.__name__):
        assert gs.GpuSensors.start(0) is None
        assert gs.GpuSensors.start(1) is None
    warnings = [r for r in caplog.records if "NVML" in r.getMessage()]
    assert len(warnings) == 1
    assert "syncless[gpu]" in warnings[0].getMessage()


def test_step_times_median_ignores_a_stall_in_fewer_than_half_the_steps():
    from syncless.profile.stragglers import StepTimes

    meta = [SectionTotals("step", "step", "step", None),
            SectionTotals("forward", "compute", "section", None),
            SectionTotals("a2a", "collective", "collective", None)]  # fmt: skip
    times, totals = StepTimes(), [0.0, 0.0, 0.0]
    per_step = [(10.0, 4.0), (10.0, 4.0), (110.0, 104.0), (10.0, 4.0), (10.0, 4.0)]
    for step_ns, forward_ns in per_step:
        totals = [totals[0] + step_ns, totals[1] + forward_ns, totals[2] + 1.0]
        times.take(totals, 0)
        times.take(totals, 0)  # nothing read in between: no step
    assert times.medians(meta).as_dict() == {"forward": 4.0}  # the mean would be 24.0
    times.reset()
    assert times.medians(meta).as_dict() == {}


def test_step_times_median_is_over_the_steps_that_ran_the_section():
    from syncless.profile.stragglers import StepTimes

    meta = [SectionTotals("step", "step", "step", None),
            SectionTotals("optimizer", "compute", "section", None),
            SectionTotals("never", "compute", "section", None)]  # fmt: skip
    times, totals = StepTimes(), [0.0, 0.0, 0.0]
    for step in range(8):  # the optimizer runs every fourth step, 7 ns each time
        totals = [totals[0] + 10.0, totals[1] + (7.0 if step % 4 == 3 else 0.0), 0.0]
        times.take(totals, 0)
    assert times.medians(meta).as_dict() == {"optimizer": 7.0}


def test_fleet_reads_ranks_of_different_layouts_and_ranks_without_medians():
    """Ranks 0-1 share a layout, rank 2 declared an extra section and skipped one, rank 3
    kept no per-step medians: each cell is what that rank said, by name."""
    from syncless.profile.summary import StepMedians

    medians = {
        0: {"forward": 10.0, "backward": 20.0, "experts": 6.0},
        1: {"forward": 11.0, "backward": 21.0, "experts": float("nan")},  # not run
        2: {"extra": 3.0, "forward": 12.0, "backward": 22.0},
    }
    summaries = []
    for rank in range(4):
        ms = {"forward": 13.0, "backward": 23.0, "experts": 7.0} if rank == 3 else medians[rank]
        s = _summary(rank, {k: v for k, v in ms.items() if v == v})
        if rank < 3:
            names = tuple(ms)
            s.step_medians = StepMedians.of(names, np.array([ms[n] * 1e6 for n in names]))
        summaries.append(s)
    report = fleet(list(reversed(summaries)))  # gathered in any order
    assert report.ranks.tolist() == [0, 1, 2, 3]
    assert report.sections == ["backward", "experts", "extra", "forward"]
    nan = float("nan")
    expected = [[20.0, 6.0, nan, 10.0], [21.0, nan, nan, 11.0], [22.0, nan, 3.0, 12.0],
                [23.0, 7.0, nan, 13.0]]  # fmt: skip
    np.testing.assert_array_equal(report.time_ms, np.array(expected))
    assert report.parents.tolist() == [-1, 3, -1, -1]  # experts sits inside forward


def test_a_verdict_names_the_host_and_gpu_of_its_rank():
    def placed(report):
        for s in report:  # two ranks a node, as the gather delivers them
            s.host, s.device = f"node-{s.rank // 2}", f"cuda:{s.rank % 2} 0000:{s.rank:02x}:00.0"
        return report

    reports = [placed(_report(8)) for _ in range(2)]
    reports.append(placed(_report(8, {5: {"data": 9 * BASE_MS["data"]}})))
    (verdict,) = _run(StragglerDetector(), reports)[-1]
    assert (verdict.rank, verdict.host, verdict.device) == (5, "node-2", "cuda:1 0000:05:00.0")
    assert "rank 5 (node-2 cuda:1 0000:05:00.0) slow in data" in verdict.describe()
